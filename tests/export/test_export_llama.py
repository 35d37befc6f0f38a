"""`iha export llama`: a P = 1 IHA folder folded into a stock folder of its source architecture computes what the IHA
folder computes (float32 logits to float32 rounding, the same greedy tokens), loaded where no IHA code exists:
transformers without remote code and stock mlx-lm, each in a process where `import iha` fails. What does not fold
(P > 1, per-head q/k norms, layouts the architecture cannot hold) is refused in one line that says why.

Stock vLLM on an exported folder: tests/serving/vllm_plugin/test_vllm_exported_llama.py (`make vllm-test`).
"""

import json

import pytest
import torch
from testing_utils import make_source, randomize_mixing, run_without_the_project

import iha
from iha import conversion as convert
from iha.cli.main import run
from iha.export import ExportError, export_llama


STOCK_PROBE = """
import json, sys
sys.modules["iha"] = None  # the package cannot be imported here
import torch
from transformers import AutoModelForCausalLM
folder, batch_path, out_path = sys.argv[1:4]
batch = json.load(open(batch_path))
input_ids, attention_mask = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # no trust_remote_code
assert type(model).__module__.startswith("transformers.models."), type(model)
with torch.no_grad():
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    greedy = model.generate(input_ids[:1], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
result = {"transformers_logits": logits.tolist(), "transformers_greedy": greedy[0].tolist()}
if batch.get("mlx"):
    import mlx.core as mx
    from pathlib import Path
    from mlx_lm.utils import load_model
    model, _ = load_model(Path(folder))  # stock mlx-lm: the folder names no model file
    assert type(model).__module__.startswith("mlx_lm.models."), type(model)
    result["mlx_logits"] = model(mx.array(batch["input_ids"][:1])).astype(mx.float32).tolist()
json.dump(result, open(out_path, "w"))
"""


def make_p1_folder(kind: str, tmp_path, **options):
    """A tiny source of `kind`, converted with P = 1, its mixing moved away from identity (as training would)."""
    source = make_source(kind, tmp_path / kind)
    folder = tmp_path / f"{kind}-iha"
    convert.convert_checkpoint(source, folder, num_pseudo_heads=1, verify=False, show_progress=False, **options)
    model = iha.IHAForCausalLM.from_pretrained(folder, dtype=torch.float32)
    randomize_mixing(model, scale=0.5, seed=1)
    model.save_pretrained(folder)
    return folder, model.eval()


def batch_of(vocab_size: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab_size, (2, 14), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    return input_ids, attention_mask


def stock_results(folder, input_ids, attention_mask, tmp_path, mlx: bool):
    batch_path, out_path = tmp_path / "batch.json", tmp_path / "stock.json"
    batch = {"input_ids": input_ids.tolist(), "attention_mask": attention_mask.tolist(), "mlx": mlx}
    batch_path.write_text(json.dumps(batch))
    result = run_without_the_project(STOCK_PROBE, str(folder), str(batch_path), str(out_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out_path.read_text())


CASES = {
    # Llama 3 (GQA, llama3 RoPE scaling, tied embeddings), per-head collapse.
    "llama3": ("llama3", {}, "LlamaForCausalLM", True),
    # Llama 2 style biases on all four projections, MHA, global collapse: the collapse reads every head.
    "llama_bias-global": ("llama_bias", {"collapse_mode": "global"}, "LlamaForCausalLM", True),
    # Qwen2: q/k/v biases, sliding layers from layer 1 on.
    "qwen2_sliding": ("qwen2_sliding", {}, "Qwen2ForCausalLM", False),
    # Mistral with a window on every layer (mlx-lm's Mistral attends fully: compared on prompts inside the window).
    "mistral_sliding": ("mistral_sliding", {}, "MistralForCausalLM", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_folder_computes_the_iha_folder_without_iha(case, tmp_path):
    kind, options, architecture, with_mlx = CASES[case]
    folder, model = make_p1_folder(kind, tmp_path, **options)
    report = export_llama(folder, tmp_path / "stock")
    assert report.architecture == architecture and report.folded_layers == [0, 1, 2]
    config = json.loads((tmp_path / "stock" / "config.json").read_text())
    assert config["architectures"] == [architecture] and "auto_map" not in config
    assert not any(key.startswith("iha_") or key == "num_pseudo_heads" for key in config)
    assert not list((tmp_path / "stock").glob("*.py"))

    input_ids, attention_mask = batch_of(model.config.vocab_size)
    if kind == "mistral_sliding":  # inside the 8-token window, where mlx-lm's full attention agrees
        input_ids, attention_mask = input_ids[:, -8:], attention_mask[:, -8:]
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        expected_greedy = model.generate(
            input_ids[:1], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0]
    stock = stock_results(tmp_path / "stock", input_ids, attention_mask, tmp_path, mlx=with_mlx)
    real = attention_mask.bool()
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(torch.tensor(stock["transformers_logits"])[real], expected[real], rtol=0, atol=tolerance)
    assert stock["transformers_greedy"] == expected_greedy.tolist()
    if with_mlx:
        torch.testing.assert_close(torch.tensor(stock["mlx_logits"])[0], expected[0], rtol=0, atol=1e-4)


def test_export_is_not_identity_in_disguise(tmp_path):
    """The folded projections differ from the source's: the mixing moved, and the export carries it."""
    folder, _ = make_p1_folder("llama3", tmp_path)
    export_llama(folder, tmp_path / "stock", verify=False)
    from safetensors.torch import load_file

    source = load_file(tmp_path / "llama3" / "model.safetensors")
    exported = load_file(tmp_path / "stock" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (source[name] - exported[name]).abs().max() > 1e-2
    assert not any("head_mixing" in key for key in exported)


def save_iha(folder, **overrides):
    from testing_utils import TINY

    torch.manual_seed(0)
    iha.IHAForCausalLM(iha.IHAConfig(**{**TINY, **overrides})).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_pseudo_heads": 2}, "P = 2 pseudo-heads per head"),
        ({"num_pseudo_heads": 1, "use_qk_norm": True}, "per-head norm does not commute with mixing heads"),
        (
            {
                "num_pseudo_heads": 1,
                "attention_types": ["iha_sliding_attention", "full_attention"],
                "sliding_window": 4,
            },
            "Llama has no sliding-window layers",
        ),
    ],
)
def test_refusals_are_one_line(overrides, message, tmp_path, capsys):
    folder = save_iha(tmp_path / "iha", **overrides)
    with pytest.raises(ExportError, match=message):
        export_llama(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    status = run("export", ["llama", str(folder), str(tmp_path / "out")], prog="iha export")
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("iha export: error: ") and message in err[0]


def test_cli_exports_and_reports_verification(tmp_path, capsys):
    folder, _ = make_p1_folder("qwen2_sliding", tmp_path)
    assert run("export", ["llama", str(folder), str(tmp_path / "out")], prog="iha export") == 0
    out = capsys.readouterr().out
    assert "Qwen2ForCausalLM" in out and "top-1 agreement 100.00%" in out
    assert run("export", ["llama", str(folder), str(tmp_path / "out")], prog="iha export") == 2
    assert "--overwrite" in capsys.readouterr().err
