"""`IHASFTTrainer`: TRL's `SFTTrainer` with the mixing parameters in their own optimizer group, FSDP on CPU, IHA cards."""

import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from trl import SFTConfig, SFTTrainer

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..utils.atomic_files import write_text_atomic
from .card import quantization_description, write_training_card
from .model import prepare_tokenizer
from .parameter_groups import IHAMixingMixin


logger = logging.getLogger(__name__)
# The Trainer saves its arguments as a pickle; the package keeps them as JSON (`training_arguments_as_json`).
TRAINING_ARGUMENTS_PICKLE = "training_args.bin"
TRAINING_ARGUMENTS_JSON = "training_args.json"


def enable_fsdp_on_cpu(accelerator, args) -> bool:
    """Make FSDP asked for on processes joined on CPU shard, as it does on GPUs. Returns whether it switched.

    accelerate builds the FSDP plugin (from `accelerate launch --use_fsdp` or a config's `distributed_type: FSDP`,
    or from the Trainer's `fsdp` / `fsdp_config`), but its state turns to FSDP only from a GPU-family distributed type:
    processes joined on CPU over gloo (`use_cpu`: `MULTI_CPU`) drop the plugin without a word and train plain data
    parallel, every process holding every weight, while the run looks like FSDP. torch's `fully_shard` runs on CPU
    over gloo, so the state is switched to FSDP with that plugin, as accelerate does for GPUs.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    # Set by `accelerate launch` for FSDP, and by the Accelerator when the Trainer hands it a plugin.
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not asked or state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None):
        return False
    plugin_args = args.fsdp_plugin_args or {}  # the Trainer's fsdp_config; without it the plugin reads FSDP_* variables
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # what every later AcceleratorState copies
    logger.info("FSDP on CPU: sharding over gloo with fully_shard (accelerate would train plain data parallel).")
    return True


@contextmanager
def own_class_while_saving(model: torch.nn.Module):
    """While saving, give a model under FSDP2 back its own class (e.g. `IHAForCausalLM`).

    `fully_shard` swaps the class of every module it shards for a generated subclass (`FSDPIHAForCausalLM`,
    defined in torch's `_fsdp_init`). `save_pretrained` of a model with custom code names the class of the object in
    `auto_map` and copies the file of its module as the model's code: it would write
    `_fsdp_init.FSDPIHAForCausalLM` and torch's FSDP sources instead of `modeling_iha.IHAForCausalLM` and the IHA
    code. Only writing happens inside (the sharded weights are gathered before); the FSDP class comes back after.
    """
    # FSDP2's class, imported only where a sharded run saves: `torch.distributed.fsdp` loads the distributed stack.
    from torch.distributed.fsdp import FSDPModule

    fsdp_class = type(model)
    if not isinstance(model, FSDPModule):
        yield
        return
    model.__class__ = next(base for base in fsdp_class.__bases__ if not issubclass(base, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = fsdp_class


def without_tied_copies(model, state_dict: dict) -> dict:
    """`state_dict` less the tied weights' copies (`lm_head.weight` of a model tying it to the input embeddings).

    FSDP's gathered state dict holds separate tensors, so `save_pretrained` cannot see that `lm_head.weight` is the
    embedding matrix (it recognises shared storage) and would write it twice. Only exact copies are dropped.
    """
    # The ties in effect for this model (empty when its config unties the embeddings); the class attribute
    # `_tied_weights_keys` lists the ties the architecture allows, whatever the config says.
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    copies = {
        target
        for target, source in tied.items()
        if target in state_dict and source in state_dict and torch.equal(state_dict[target], state_dict[source])
    }
    return {name: tensor for name, tensor in state_dict.items() if name not in copies}


def training_arguments_as_json(folder: str | os.PathLike, args) -> None:
    """Keep the training arguments next to the model as `training_args.json` instead of the Trainer's
    `training_args.bin`: that file is a pickle (loading it runs code), which a folder meant for the Hub must not hold,
    and nothing reads it back (resuming reads `trainer_state.json` and the optimizer files)."""
    write_text_atomic(args.to_json_string() + "\n", Path(folder, TRAINING_ARGUMENTS_JSON))
    Path(folder, TRAINING_ARGUMENTS_PICKLE).unlink(missing_ok=True)


def training_tokenizer(tokenizer, args: SFTConfig | None):
    """The tokenizer as training uses it, prepared in this one place: `IHASFTTrainer` calls it, and `train_sft` before
    its length filter (which must count the tokens of the template training uses; a second call changes nothing).

    A `.jinja` / `.j2` file given as `args.chat_template_path` becomes the chat template, and the path is cleared:
    TRL's `SFTTrainer` would read it again and replace the `{% generation %}` markers added next. Then what training
    needs (`prepare_tokenizer`): the markers when the loss is on the assistant turns only, and a pad token.
    """
    template_path = getattr(args, "chat_template_path", None)
    if template_path is not None and str(template_path).endswith((".jinja", ".j2")):
        tokenizer.chat_template = Path(template_path).read_text(encoding="utf-8")
        args.chat_template_path = None
    return prepare_tokenizer(tokenizer, assistant_only_loss=args is not None and args.assistant_only_loss)


class IHASFTTrainer(IHAMixingMixin, SFTTrainer):
    """`SFTTrainer` whose optimizer gives the IHA mixing parameters their own learning rate and weight decay
    (`iha.training.parameter_groups`), keeping them in fp32; the one owner of the tokenizer's preparation and of the
    model card.

    Reads `mixing_learning_rate` / `mixing_weight_decay` from `IHASFTConfig`; with a plain `SFTConfig` the mixing
    parameters take `learning_rate` and no weight decay. The tokenizer is prepared for training by
    `training_tokenizer`. The IHA model card it writes (`create_model_card`) tells what the trainer knows (the
    model's folder, the rows, LoRA, the quantization of the base) and what `card_details` adds: where the rows came
    from (`train_source`), the base the model was loaded from (`base`) and whether it was converted to IHA on the way
    (`converted`).
    """

    def __init__(self, model, args: SFTConfig | None = None, *, card_details: dict | None = None, **kwargs):
        if kwargs.get("processing_class") is not None:
            kwargs["processing_class"] = training_tokenizer(kwargs["processing_class"], args)
        train_dataset = kwargs.get("train_dataset")
        super().__init__(model, args, **kwargs)
        config = getattr(self.model, "config", None)
        # What the model card says about the run (`write_training_card`): what the trainer knows, with what
        # `card_details` gives over it.
        self.card_details = {
            "base": getattr(config, "_name_or_path", None) or None,
            "converted": False,
            "train_source": train_dataset,
            # The rows as given, before tokenizing and packing (an iterable dataset has no length).
            "num_rows": len(train_dataset) if hasattr(train_dataset, "__len__") else None,
            "peft_config": kwargs.get("peft_config"),
            "quantization": quantization_description(getattr(config, "quantization_config", None)),
            **{key: value for key, value in (card_details or {}).items() if value is not None},
        }

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if enable_fsdp_on_cpu(self.accelerator, self.args):
            # Again, now that accelerate's state says FSDP: the Trainer's own FSDP setup and checks.
            super().create_accelerator_and_postprocess()

    def _save(self, output_dir=None, state_dict=None):
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is not None:
            state_dict = without_tied_copies(model, state_dict)
        with own_class_while_saving(model):
            super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            training_arguments_as_json(output_dir or self.args.output_dir, self.args)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        # TRL writes its generic card into output_dir at every checkpoint save: write the IHA card instead.
        if self.is_world_process_zero():
            write_training_card(self.args.output_dir, self, **self.card_details)
