"""torch.compile of IHA models: the compiled model gives the eager model's logits, loss and gradients, in one graph.

`fullgraph=True` makes any graph break an error, so these tests also count the breaks: zero on every layout and input
below. The backend is `aot_eager` (dynamo's tracing and AOTAutograd's functionalised forward and backward, without
inductor's C++ code generation, which takes minutes per graph on a small CPU) unless `--compile_backend inductor`
says otherwise (scripts/gpu_check.py compiles with inductor on CUDA); generation with a static cache runs through
transformers' own compiled decoding (`generate` with a `CompileConfig`).
"""

import pytest
import torch
from testing_utils import TINY, greedy_without_cache, left_padded_batch, sharpen_attention, tiny_iha_model
from transformers import CompileConfig


LAYOUTS = {
    "every layer IHA": {},
    "token causal": {"iha_mask_mode": "token_causal"},
    # A sliding IHA layer long enough for the blocked local path, a standard global and a standard sliding layer.
    "hybrid": {
        "num_hidden_layers": 3,
        "attention_types": ["iha_sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 3,
    },
}
# Long enough for the sliding IHA layer's blocked local path (blocks of 32 tokens at P = 2).
SEQ_LEN = 72
# One row of three documents (30, 5 and 37 tokens), as TRL's padding-free packing sends it.
PACKED_POSITIONS = [*range(30), *range(5), *range(37)]


def model_inputs(kind: str, vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    if kind == "padded":
        input_ids, attention_mask = left_padded_batch(vocab_size, seq_len=SEQ_LEN)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids}
    if kind == "packed":
        input_ids = torch.randint(0, vocab_size, (1, len(PACKED_POSITIONS)), generator=generator)
        return {"input_ids": input_ids, "position_ids": torch.tensor([PACKED_POSITIONS]), "labels": input_ids}
    input_ids = torch.randint(0, vocab_size, (2, SEQ_LEN), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids}


def loss_logits_and_gradients(model, inputs: dict, run=None):
    """Loss, logits and the gradient of every parameter of `model`, run through `run` (a compiled `model`) if given."""
    model.zero_grad()
    outputs = (model if run is None else run)(**inputs, use_cache=False)
    outputs.loss.backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    return outputs.loss.detach(), outputs.logits.detach(), gradients


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_training_step_matches_eager_in_one_graph(layout, kind, precision):
    torch._dynamo.reset()
    model = precision.model(sharpen_attention(tiny_iha_model(**LAYOUTS[layout])))
    model.train()
    inputs = precision.to_device(model_inputs(kind, model.config.vocab_size))
    eager_loss, eager_logits, eager_gradients = loss_logits_and_gradients(model, inputs)
    compiled = torch.compile(model, backend=precision.compile_backend, fullgraph=True)
    compiled_loss, compiled_logits, compiled_gradients = loss_logits_and_gradients(model, inputs, run=compiled)
    precision.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)
    precision.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, gradient in eager_gradients.items():
        precision.assert_close(compiled_gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name, gradient=True)


def test_compiled_forward_of_packed_rows_keeps_documents_apart(precision):
    # Compiled forwards take the dense mask with document ids (not the per-document kernel, which reads lengths on the
    # host); a token must still not see the document before it: its logits equal those of its document alone.
    torch._dynamo.reset()
    model = precision.model(sharpen_attention(tiny_iha_model()).eval())
    inputs = precision.to_device(model_inputs("packed", model.config.vocab_size))
    compiled = torch.compile(model, backend=precision.compile_backend, fullgraph=True)
    with torch.no_grad():
        packed_logits = compiled(inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False).logits
        second_document = inputs["input_ids"][:, 30:35]
        alone_logits = model(second_document, use_cache=False).logits
    precision.assert_close(packed_logits[:, 30:35], alone_logits, rtol=1e-5, atol=1e-5)


def record_attention_paths(monkeypatch) -> list[str]:
    """The kernels IHA layers run through the installed package's SDPA paths (`iha/attention/sdpa.py`), in call order;
    standard layers call transformers' own function directly and are not recorded."""
    from iha.attention import sdpa

    paths = []
    kernels = {
        "blocked_local_attention": "blocked_local",
        "per_document_attention": "per_document",
        "masked_sdpa_sharing_kv_heads": "sdpa_sharing_kv_heads",
        "sdpa_attention_forward": "backend",
    }
    for name, path in kernels.items():

        def recording(*args, _kernel=getattr(sdpa, name), _path=path, **kwargs):
            paths.append(_path)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(sdpa, name, recording)
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_attention_paths_eager_and_compiled(monkeypatch, compiled, precision):
    # Eager packed rows keep the per-document kernel; compiled ones take the dense masked path (SDPA sharing KV heads
    # on CPU, transformers' SDPA elsewhere). The sliding IHA layer of the hybrid layout takes the blocked local kernel
    # either way (so the training test above compiles it).
    torch._dynamo.reset()
    paths = record_attention_paths(monkeypatch)
    every_layer = precision.model(tiny_iha_model())
    hybrid = precision.model(tiny_iha_model(**LAYOUTS["hybrid"]))
    if compiled:
        every_layer = torch.compile(every_layer, backend=precision.compile_backend, fullgraph=True)
        hybrid = torch.compile(hybrid, backend=precision.compile_backend, fullgraph=True)
    packed = precision.to_device(model_inputs("packed", TINY["vocab_size"]))
    every_layer(packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
    dense_path = "sdpa_sharing_kv_heads" if precision.device.type == "cpu" else "backend"
    assert paths == [dense_path if compiled else "per_document"] * TINY["num_hidden_layers"]
    paths.clear()
    hybrid(precision.to_device(model_inputs("plain", TINY["vocab_size"])["input_ids"]), use_cache=False)
    assert paths == ["blocked_local"]


@pytest.mark.parametrize("layout", ["every layer IHA", "hybrid"])
def test_generate_with_static_cache_compiled_matches_greedy_without_cache(layout, precision):
    torch._dynamo.reset()
    model = precision.model(sharpen_attention(tiny_iha_model(**LAYOUTS[layout])).eval())
    input_ids, attention_mask = precision.to_device(*left_padded_batch(model.config.vocab_size, seq_len=9))
    gaps = []
    expected = greedy_without_cache(model, input_ids, attention_mask, steps=6, relative_gaps=gaps)
    compile_config = CompileConfig(fullgraph=True, backend=precision.compile_backend, mode=None)
    compile_config._compile_all_devices = True  # transformers compiles decoding on accelerators only by default
    generated = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=6,
        do_sample=False,
        cache_implementation="static",
        compile_config=compile_config,
        pad_token_id=0,
    )
    assert hasattr(model, "_compiled_call"), "generate did not take the compiled decoding path"
    precision.assert_same_greedy(generated, expected, gaps, input_ids.shape[1])
