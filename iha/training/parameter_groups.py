"""The IHA mixing's own learning rate and weight decay, and its fp32 precision, for any `transformers.Trainer`.

`with_iha_mixing(DPOTrainer)` (or GRPOTrainer, SFTTrainer, a plain Trainer, ...) is that trainer with one more pair of
settings: `mixing_learning_rate` and `mixing_weight_decay`, given to the trainer or read from its `args` (as
`IHASFTConfig` has them). The optimizer then holds three groups: weights with decay, weights without decay (norms,
biases), and the mixing coefficients and collapse weights with their own rate and decay. The trainer also keeps the
mixing in fp32 after its own set-up: TRL casts every trainable parameter of a quantized (QLoRA) model to bf16, which
would freeze the mixing entries that start at 0 or 1 (an update of ~lr is below half the spacing of bf16 near 1.0).
"""

from typing import Any

import torch

from .config import is_mixing_parameter


def iha_parameter_groups(
    model: torch.nn.Module,
    decay_parameter_names: set[str],
    weight_decay: float,
    mixing_learning_rate: float | None,
    mixing_weight_decay: float,
) -> list[dict[str, Any]]:
    """Optimizer groups: weights with decay, weights without decay (norms, biases), and the IHA mixing parameters
    with their own learning rate and weight decay. Frozen parameters are left out; empty groups are dropped."""
    decay, no_decay, mixing = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if is_mixing_parameter(name):
            mixing.append(parameter)
        elif name in decay_parameter_names:
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    mixing_group = {"params": mixing, "weight_decay": mixing_weight_decay, "iha_group": "mixing"}
    if mixing_learning_rate is not None:
        mixing_group["lr"] = mixing_learning_rate
    groups = [
        {"params": decay, "weight_decay": weight_decay, "iha_group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "iha_group": "no_decay"},
        mixing_group,
    ]
    return [group for group in groups if group["params"]]


def keep_mixing_in_fp32(model: torch.nn.Module) -> int:
    """Cast every 16-bit mixing parameter of `model` (PEFT's trainable copies included) to fp32; returns how many."""
    cast = 0
    for name, parameter in model.named_parameters():
        if is_mixing_parameter(name) and parameter.dtype in (torch.bfloat16, torch.float16):
            parameter.data = parameter.data.float()
            cast += 1
    return cast


def refuse_mixed_dtypes_under_fsdp(model: torch.nn.Module) -> None:
    """FSDP gathers each `IHADecoderLayer` as one unit and needs one dtype in it: 16-bit weights beside the fp32
    mixing cannot be sharded. Refuses with the fix (fp32 weights, 16-bit mixed precision) instead of failing later
    inside torch's all-gather."""
    weights, mixing = set(), set()
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point():
            (mixing if is_mixing_parameter(name) else weights).add(parameter.dtype)
    if mixing and weights and weights != mixing:
        names = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in weights))
        raise ValueError(
            f"FSDP shards each IHA layer as one unit of one dtype, but the weights are {names} and the IHA mixing "
            "float32 (kept so that its identity entries can learn). Load the weights in float32 (iha-sft's default "
            "--dtype float32) and train in bf16 mixed precision (--bf16 true, or accelerate's mixed_precision bf16)."
        )


class IHAMixingMixin:
    """Put before a `transformers.Trainer` subclass: the mixing gets its own optimizer group and stays in fp32.

    `mixing_learning_rate` (default: `args.mixing_learning_rate` if the config has one, else `learning_rate`) and
    `mixing_weight_decay` (default: `args.mixing_weight_decay`, else 0.0: decay pulls the mixing to zero, not to
    the identity it starts from) are keyword arguments of the trainer. `with_iha_mixing` builds the class.
    """

    def __init__(
        self, *args, mixing_learning_rate: float | None = None, mixing_weight_decay: float | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        if mixing_learning_rate is None:
            mixing_learning_rate = getattr(self.args, "mixing_learning_rate", None)
        if mixing_weight_decay is None:
            mixing_weight_decay = getattr(self.args, "mixing_weight_decay", 0.0)
        self.mixing_learning_rate = mixing_learning_rate
        self.mixing_weight_decay = mixing_weight_decay
        keep_mixing_in_fp32(self.model)
        if getattr(self, "is_fsdp_enabled", False):
            refuse_mixed_dtypes_under_fsdp(self.model)

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs = dict(optimizer_kwargs)
        if not isinstance(optimizer_cls, type) or {"params", "model", "optimizer_dict"} & optimizer_kwargs.keys():
            # GaLore, LOMO, Muon factories, layer-wise optimizers... build their own groups.
            if self.mixing_learning_rate is not None:
                raise ValueError(
                    f"`mixing_learning_rate` needs a standard optimizer (e.g. `--optim adamw_torch`), but "
                    f"`optim={self.args.optim}` builds its own parameter groups. Unset `mixing_learning_rate` to use it."
                )
            return super().create_optimizer(model)
        groups = iha_parameter_groups(
            opt_model,
            set(self.get_decay_parameter_names(opt_model)),
            weight_decay=self.args.weight_decay,
            mixing_learning_rate=self.mixing_learning_rate,
            mixing_weight_decay=self.mixing_weight_decay,
        )
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


def with_iha_mixing(trainer_class: type) -> type:
    """`trainer_class` (any `transformers.Trainer` subclass: TRL's DPOTrainer, GRPOTrainer, ...) whose optimizer gives
    the IHA mixing its own learning rate and weight decay, and which keeps the mixing in fp32.

    ```python
    >>> from trl import DPOTrainer
    >>> trainer = with_iha_mixing(DPOTrainer)(model=..., args=..., train_dataset=..., mixing_learning_rate=1e-3)
    ```
    """
    if issubclass(trainer_class, IHAMixingMixin):
        return trainer_class
    return type(f"IHA{trainer_class.__name__}", (IHAMixingMixin, trainer_class), {"__module__": __name__})
