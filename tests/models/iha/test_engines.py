"""Engines IHA cannot be right under stop with one line (iha/models/iha/modeling_iha.py `check_attention_implementation`).

vLLM's and SGLang's Transformers backends are not installed here: the tests drive the model the way they do. Both set
the text config's `_attn_implementation` to their own name ("vllm", "sglang") before `AutoModel.from_config`, register
an attention function under it, and call the model on one packed row [1, tokens] with their paged attention layers in
`attention_instances`; the function flattens q / k / v to [tokens, heads * d] and hands them to the layer of
`module.layer_idx`, whose kernel keeps one key per real token.
"""

import pytest
import torch
from testing_utils import tiny_iha_config, tiny_iha_model
from transformers import AutoModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import iha


ENGINES = {"vllm": "vLLM's Transformers backend", "sglang": "SGLang's Transformers backend"}


class TokenCausalAttentionLayer:
    """Stands for an engine's paged attention layer: causal attention over real tokens, [tokens, heads * d] in and out."""

    def __init__(self, num_heads, num_kv_heads, head_dim):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.calls = 0

    def __call__(self, query, key, value, **kwargs):
        self.calls += 1
        tokens = query.shape[0]
        query = query.view(tokens, -1, self.head_dim).transpose(0, 1)
        key = key.view(tokens, -1, self.head_dim).transpose(0, 1)
        value = value.view(tokens, -1, self.head_dim).transpose(0, 1)
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, enable_gqa=query.shape[0] != key.shape[0]
        )
        return output.transpose(0, 1).reshape(tokens, -1)


def engine_attention_forward(module, query, key, value, attention_mask, scaling=None, attention_instances=None, **kw):
    """The call shape of vLLM's `vllm_flash_attention_forward` and SGLang's `sglang_flash_attention_forward`."""
    tokens = query.shape[-2]
    query, key, value = (x.transpose(1, 2).reshape(tokens, -1) for x in (query, key, value))
    return attention_instances[module.layer_idx](query, key, value), None


@pytest.fixture
def engine_registered():
    """Register the engine's attention names as the engines do; removed again after the test."""
    for name in ENGINES:
        AttentionInterface.register(name, engine_attention_forward)
    try:
        yield
    finally:
        for name in ENGINES:
            ALL_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)


def engine_layers(config):
    head_dim = config.hidden_size // config.num_attention_heads
    return {
        index: TokenCausalAttentionLayer(config.num_attention_heads, config.num_key_value_heads, head_dim)
        for index in range(config.num_hidden_layers)
    }


@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_engine_building_the_model_is_refused_at_load(engine, engine_registered):
    config = tiny_iha_config(num_pseudo_heads=2)
    config._attn_implementation = engine  # what the engines' backends do before building the model
    with torch.device("meta"), pytest.raises(ValueError) as error:
        AutoModel.from_config(config)
    message = str(error.value)
    assert "\n" not in message
    assert ENGINES[engine] in message
    assert "one key per real token" in message
    assert "iha serve" in message


@pytest.mark.parametrize("layout", ["every-layer", "hybrid"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_engine_calling_the_layers_is_refused(engine, layout, engine_registered):
    options = {}
    if layout == "hybrid":
        options = dict(num_hidden_layers=5, **iha.paper_hybrid_layout(5, 2, training_length=24))
    model = tiny_iha_model(num_pseudo_heads=2, **options)
    layers = engine_layers(model.config)
    input_ids = torch.arange(3, 10)[None]  # one packed row, as the engines send it
    engine_kwargs = {"forward_batch": object()} if engine == "sglang" else {}
    # Refused where the implementation is chosen (set_attn_implementation), before any forward.
    with torch.no_grad(), pytest.raises(ValueError, match=ENGINES[engine]):
        model.set_attn_implementation(engine)
        model(input_ids, position_ids=torch.arange(7)[None], attention_instances=layers, **engine_kwargs)
    iha_layers = model.config.iha_layer_indices
    assert all(layers[index].calls == 0 for index in iha_layers), "an IHA layer ran under the engine's kernel"


def test_any_backend_passing_attention_instances_is_refused(engine_registered):
    # An engine that registers its attention under a name of its own is recognised by its call.
    AttentionInterface.register("some_engine", engine_attention_forward)
    try:
        model = tiny_iha_model(num_pseudo_heads=2)
        model.set_attn_implementation("sdpa")
        with torch.no_grad(), pytest.raises(ValueError, match="attention_instances"):
            model(torch.arange(3, 8)[None], attention_instances=engine_layers(model.config))
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping.pop("some_engine", None)


def test_an_unknown_attention_implementation_is_refused():
    AttentionInterface.register("my_kernel", engine_attention_forward)
    try:
        model = tiny_iha_model(num_pseudo_heads=2)
        with torch.no_grad(), pytest.raises(ValueError, match="not 'my_kernel'"):
            model.set_attn_implementation("my_kernel")
            model(torch.arange(3, 8)[None])
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping.pop("my_kernel", None)


def test_continuous_batching_names_outside_continuous_batching_are_refused():
    model = tiny_iha_model(num_pseudo_heads=2)
    model.set_attn_implementation("paged|eager")
    with torch.no_grad(), pytest.raises(ValueError, match="runs only under continuous batching"):
        model(torch.arange(3, 8)[None])


def test_standard_models_under_the_engine_name_are_left_alone(engine_registered):
    # A model without IHA layers is plain Llama attention: the engines serve it like any Llama.
    config = tiny_iha_config(attention_types=["full_attention", "full_attention"])
    config._attn_implementation = "vllm"
    with torch.device("meta"):
        AutoModel.from_config(config)
