"""Converting a model already in memory: `llama_to_iha(model, options)`."""

import copy
import logging
from collections.abc import Mapping

import torch

from ..models.iha.modeling_iha import IHAForCausalLM, IHAHeadMixing
from .errors import ConversionError
from .options import IHAConversionOptions, refuse_unknown_keywords, settings_from
from .plan import IGNORED_SOURCE_SUFFIXES, iha_causal_lm_class, plan_conversion


logger = logging.getLogger(__name__)


def llama_to_iha(
    model, options: IHAConversionOptions | Mapping | None = None, *, share_weights: bool = False, **settings
) -> IHAForCausalLM:
    """Convert a loaded model of a supported architecture (Llama, Mistral, Qwen2, Qwen3, SmolLM3: an
    `IHAForCausalLM`; Gemma 3: an `IHAGemma3ForCausalLM`; see `iha.conversion.SUPPORTED_ARCHITECTURES`).

    `options` are the `IHAConversionOptions` (or a dict of them); `settings` set single ones by name, on top
    (`llama_to_iha(model, num_pseudo_heads=4)`). With the defaults the result computes the same logits as `model`
    (up to fp32 rounding). The new model gets copies of the weights, or, with `share_weights=True`, the very same
    tensors (no extra memory; training one then changes the other). Settings that change the function are logged
    as a warning; see `plan_conversion(...).function_changes`.
    """
    options, rest = settings_from(IHAConversionOptions, options, settings)
    refuse_unknown_keywords("llama_to_iha", rest, IHAConversionOptions)
    plan = plan_conversion(model.config, options)
    for change in plan.function_changes:
        logger.warning(f"This conversion changes what the model computes: {change}.")
    config = plan.config
    config._attn_implementation = model.config._attn_implementation
    config.dtype = model.dtype

    # Build on the meta device and take the source tensors in place: no random init, no second full model.
    with torch.device("meta"):
        iha_model = iha_causal_lm_class(config.model_type)(config)
    state_dict = {
        name: tensor if share_weights else tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if not name.endswith(IGNORED_SOURCE_SUFFIXES) and not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    result = iha_model.load_state_dict(state_dict, strict=False, assign=True)
    expected_missing = {name for name in iha_model.state_dict() if ".head_mixing." in name}
    if config.tie_word_embeddings:
        expected_missing.add("lm_head.weight")
    unexpected_missing = sorted(set(result.missing_keys) - expected_missing)
    if unexpected_missing or result.unexpected_keys:
        raise ConversionError(
            f"The source model's weights do not fit the IHA model: missing {unexpected_missing}, "
            f"unexpected {sorted(result.unexpected_keys)}."
        )
    device = model.get_input_embeddings().weight.device
    # The mixing stays fp32 beside 16-bit weights, as `from_pretrained` loads it: in bf16 its identity entries could
    # not learn.
    dtype = torch.promote_types(model.get_input_embeddings().weight.dtype, torch.float32)
    for module in iha_model.modules():
        if isinstance(module, IHAHeadMixing):
            for name, value in module.identity_tensors().items():
                setattr(module, name, torch.nn.Parameter(value.to(device=device, dtype=dtype).contiguous()))
    # Non-persistent buffers (RoPE inverse frequencies) are not in the state dict: take the source's, computed
    # from the same rope parameters.
    source_buffers = dict(model.named_buffers())
    for name, buffer in list(iha_model.named_buffers()):
        if buffer.is_meta:
            if name not in source_buffers:
                raise ConversionError(f"The IHA model's buffer {name} has no counterpart in the source model.")
            module_name, _, buffer_name = name.rpartition(".")
            iha_model.get_submodule(module_name)._buffers[buffer_name] = source_buffers[name].clone()
    if config.tie_word_embeddings:
        iha_model.tie_weights()
    iha_model.generation_config = copy.deepcopy(model.generation_config)
    iha_model.train(model.training)
    return iha_model
