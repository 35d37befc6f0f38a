"""Shared fixtures: tiny IHA / Llama models and the offline environment."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
sys.path.insert(0, str(TESTS_DIR))

import iha  # noqa: E402  (registers the Auto classes)


TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def tiny_iha_config(**overrides) -> iha.IHAConfig:
    return iha.IHAConfig(**{**TINY, **overrides})


def randomize_mixing(model, scale: float = 0.3, seed: int = 0):
    """Move every mixing coefficient and collapse weight away from identity, so tests see real mixing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".head_mixing." in name:
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.add_((scale * noise).to(parameter.dtype))
    return model


def tiny_iha_model(seed: int = 0, randomize: bool = True, **overrides):
    torch.manual_seed(seed)
    model = iha.IHAForCausalLM(tiny_iha_config(**overrides)).eval()
    if randomize:
        randomize_mixing(model, seed=seed)
    return model


def tiny_llama_for_tokenizer(tokenizer, seed: int = 0, **overrides):
    """A tiny random Llama (GQA, tied embeddings) sized to `tokenizer`, with its special token ids: a stand-in for a
    real checkpoint wherever a test needs real text (chat templates, generation, lm_eval) but not real weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def left_padded_batch(vocab_size: int = TINY["vocab_size"], seq_len: int = 9, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (3, seq_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :5] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def generation_position_ids(attention_mask):
    # What `generate` does for left padding: positions count real tokens only.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def run_without_the_project(code: str, *args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in a fresh process without the project on its path (no PYTHONPATH), offline, with its own
    cache of remote-code modules under `cwd`: how a Hub user who never installed `iha` loads a folder. `code` blocks
    `import iha` itself, since the package may be installed in this environment."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "modules"), TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,  # a prompt (remote code, say) would read EOF at once instead of waiting
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A folder with a tiny random Llama, the real SmolLM2 tokenizer and its chat template."""
    from transformers import AutoTokenizer

    from iha.builtin import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_for_tokenizer(tokenizer, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"benchmark data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def paused_command():
    """paused_command(ready, target, nth, argv): `iha ARGV` in a subprocess stopped before the nth call of target
    (see fault_utils.start_process), for tests that signal a command mid-work; killed after the test if still alive."""
    from fault_utils import start_process

    processes = []

    def start(*args, **kwargs):
        process = start_process(*args, **kwargs)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.communicate()
