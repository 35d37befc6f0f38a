"""Stock mlx-lm reads an IHA folder through the MLX model file `iha export mlx` adds (`model_file`, trust_remote_code):
float32 logits within float32 rounding of transformers', and the greedy tokens of `generate()` through mlx-lm's own
cached decoding (`generate_step`) and batched decoding (`BatchGenerator`, prompts of different lengths padded
together), for P = 2 and 3, GQA and MHA, shared and virtual positions, per-head and global collapse, flat and token
causal masks, sliding IHA layers (the paper's window of W * P virtual tokens), the paper's hybrid layout, standard
layers among IHA ones, Qwen3's q/k norm, SmolLM3's NoPE layers and Llama 3's RoPE scaling. Gemma 3 is refused in one
line. A config.json that names no IHA field is exported with what they mean. The real SmolLM2-135M-Instruct converted with the defaults gives the source's greedy tokens through mlx-lm
(tests/models/mlx/test_mlx_smollm2.py)."""

import json

import pytest
import torch


pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from testing_utils import TINY, randomize_mixing  # noqa: E402

import iha  # noqa: E402
from iha.cli.main import run  # noqa: E402
from iha.export import ExportError  # noqa: E402
from iha.export.mlx import MLX_MODEL_FILE, add_mlx_model_file  # noqa: E402
from iha.models.iha.layer_iha import FIELD_DEFAULTS  # noqa: E402


# A wider init than TINY's default, so that greedy tokens are decided by clear margins rather than rounding.
MLX_TINY = {**TINY, "initializer_range": 0.1}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "P2-gqa-virtual-flat": dict(num_pseudo_heads=2, num_key_value_heads=2),
    "P2-gqa-virtual-flat-pseudo-cache": dict(num_pseudo_heads=2, num_key_value_heads=2, iha_cache_mode="pseudo"),
    "P3-mha-shared-global": dict(num_pseudo_heads=3, iha_position_mode="shared", iha_collapse_mode="global"),
    "P2-token-causal-global-gqa": dict(
        num_pseudo_heads=2, iha_mask_mode="token_causal", iha_collapse_mode="global", num_key_value_heads=2
    ),
    "P3-sliding": dict(num_pseudo_heads=3, sliding_window=4),
    "P3-sliding-pseudo-cache": dict(num_pseudo_heads=3, sliding_window=4, iha_cache_mode="pseudo"),
    "P2-sliding-shared": dict(num_pseudo_heads=2, sliding_window=4, iha_position_mode="shared"),
    "P2-shared-pseudo-cache": dict(num_pseudo_heads=2, iha_position_mode="shared", iha_cache_mode="pseudo"),
    "P2-standard-and-iha-layers": dict(
        num_hidden_layers=4,
        num_pseudo_heads=2,
        attention_types=["iha_full_attention", "full_attention", "sliding_attention", "iha_sliding_attention"],
        sliding_window=5,
    ),
    "P2-qwen3-qk-norm-qkv-bias-untied": dict(
        num_pseudo_heads=2, use_qk_norm=True, qkv_bias=True, o_proj_bias=False, tie_word_embeddings=False
    ),
    "P3-smollm3-nope-biases": dict(num_pseudo_heads=3, no_rope_layers=[1, 0], attention_bias=True),
    "P2-llama3-rope": dict(num_pseudo_heads=2, rope_parameters=LLAMA3_ROPE, num_key_value_heads=1),
}


def paper_hybrid_config():
    """The paper's layout: 4 sliding IHA layers (window N / (2 P^2) = 4 tokens, 8 virtual tokens) : 1 global MHA."""
    return iha.IHAConfig.paper_hybrid(training_length=32, **{**MLX_TINY, "num_hidden_layers": 5, "num_pseudo_heads": 2})


def iha_folder(config, folder, seed: int = 0):
    torch.manual_seed(seed)
    model = iha.IHAForCausalLM(config).eval()
    randomize_mixing(model, scale=0.5, seed=seed)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    add_mlx_model_file(folder)
    return model


def config_of(case: str):
    if case == "paper-hybrid":
        return paper_hybrid_config()
    return iha.IHAConfig(**{**MLX_TINY, **CASES[case]})


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))


def reference_greedy(model, input_ids: torch.Tensor, steps: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, input_ids.shape[1] :].tolist()


@pytest.mark.parametrize("case", [*sorted(CASES), "paper-hybrid"])
def test_mlx_lm_computes_transformers_logits_and_greedy_tokens(case, tmp_path):
    model = iha_folder(config_of(case), tmp_path / "iha")
    mlx_model, _ = load_model(tmp_path / "iha", trust_remote_code=True)
    assert type(mlx_model).__module__ == "custom_model"  # mlx-lm built it from the folder's model file

    input_ids = prompt(13, seed=1)
    with torch.no_grad():
        expected = model(input_ids).logits[0]
    logits = torch.from_numpy(np.array(mlx_model(mx.array(input_ids.numpy()))[0]))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())

    steps = 24
    tokens = [int(token) for token, _ in generate_step(mx.array(input_ids[0].numpy()), mlx_model, max_tokens=steps)]
    assert tokens == reference_greedy(model, input_ids, steps)


@pytest.mark.parametrize("case", ["P2-gqa-virtual-flat", "P2-gqa-virtual-flat-pseudo-cache", "paper-hybrid"])
def test_batched_prompts_with_padding_give_each_prompts_own_tokens(case, tmp_path):
    model = iha_folder(config_of(case), tmp_path / "iha")
    mlx_model, _ = load_model(tmp_path / "iha", trust_remote_code=True)
    prompts = [prompt(length, seed=length) for length in (5, 14, 9)]
    steps = 12
    generator = BatchGenerator(mlx_model, stop_tokens=[], max_tokens=steps)
    uids = generator.insert([p[0].tolist() for p in prompts], [steps] * len(prompts))
    tokens = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            tokens[response.uid].append(int(response.token))
    generator.close()
    for uid, input_ids in zip(uids, prompts):
        assert tokens[uid] == reference_greedy(model, input_ids, steps)


def test_mixing_stays_float32_when_mlx_lm_casts_the_model(tmp_path):
    """`mlx_lm.convert --dtype bfloat16` casts every parameter its model's `cast_predicate` allows: not the mixing."""
    from mlx.utils import tree_flatten
    from mlx_lm.convert import convert
    from testing_utils import build_tiny_tokenizer

    iha_folder(config_of("P2-gqa-virtual-flat"), tmp_path / "iha")
    build_tiny_tokenizer(tmp_path / "iha")  # mlx_lm.convert loads and saves the tokenizer too
    convert(str(tmp_path / "iha"), str(tmp_path / "bf16"), dtype="bfloat16", trust_remote_code=True)
    mlx_model, _ = load_model(tmp_path / "bf16", trust_remote_code=True)
    dtypes = {name: value.dtype for name, value in tree_flatten(mlx_model.parameters())}
    assert {dtypes[name] for name in dtypes if ".head_mixing." in name} == {mx.float32}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == mx.bfloat16
    assert (tmp_path / "bf16" / MLX_MODEL_FILE).is_file()


def test_a_config_json_without_iha_fields_is_exported_with_what_they_mean(tmp_path):
    """A config.json that names no IHA field means their defaults and the attention types the config class fills in
    (sliding IHA layers here, as `sliding_window` is set); the MLX file declares no defaults, so the export writes those
    values, and mlx-lm computes transformers' logits from the folder."""
    folder = tmp_path / "iha"
    torch.manual_seed(0)
    source = iha.IHAForCausalLM(iha.IHAConfig(**{**MLX_TINY, "sliding_window": 4})).eval()
    randomize_mixing(source, scale=0.5, seed=0)
    source.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    bare = {key: value for key, value in config.items() if key not in FIELD_DEFAULTS}
    (folder / "config.json").write_text(json.dumps(bare))

    add_mlx_model_file(folder)
    model = iha.IHAForCausalLM.from_pretrained(folder).eval()
    written = json.loads((folder / "config.json").read_text())
    assert {name: written[name] for name in FIELD_DEFAULTS} == {name: config[name] for name in FIELD_DEFAULTS}
    assert set(written["attention_types"]) == {"iha_sliding_attention"}
    mlx_model, _ = load_model(folder, trust_remote_code=True)
    input_ids = prompt(13, seed=1)
    with torch.no_grad():
        expected = model(input_ids).logits[0]
    logits = torch.from_numpy(np.array(mlx_model(mx.array(input_ids.numpy()))[0]))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_stock_mlx_lm_asks_before_running_the_folders_code(tmp_path):
    iha_folder(config_of("P2-gqa-virtual-flat"), tmp_path / "iha")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_model(tmp_path / "iha")
    # transformers ignores the key: the folder loads as before.
    config = json.loads((tmp_path / "iha" / "config.json").read_text())
    assert config["model_file"] == MLX_MODEL_FILE
    assert iha.IHAForCausalLM.from_pretrained(tmp_path / "iha").config.num_pseudo_heads == 2


def test_gemma3_and_non_iha_folders_are_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "iha_gemma3"}))
    with pytest.raises(ExportError, match="Gemma 3 IHA folders do not run on MLX"):
        add_mlx_model_file(folder)
    capsys.readouterr()
    assert run("export", ["mlx", str(folder)], prog="iha export") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Gemma 3" in err[0]
    assert not (folder / MLX_MODEL_FILE).exists()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ExportError, match="not an IHA folder"):
        add_mlx_model_file(folder)
