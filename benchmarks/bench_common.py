"""What the benchmark scripts in this folder share: the device, the models, the step functions and the clocks.

`bench_perf.py` and `bench_compile.py` build a random `LlamaForCausalLM` (`base_model`) and the IHA model converted
from its weights (`converted_iha_model`: same state dict, identity head mixing), and time their steps
(`forward_step`, `train_step`, `generation_step`) side by side with `alternate`: the steps take turns, the order
flips every round, and both the wall-clock and the process's CPU seconds are recorded, so that load from other
processes falls on both models alike. `peak_memory_of` measures a step's peak memory (the process's resident size on
CPU, the CUDA allocator's peak on a GPU).

The device and dtype are set once per run with `use_device` (`choose_device`: CUDA with bfloat16 where present,
else CPU with float32).
"""

import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import iha  # noqa: E402


RESULTS_DIR = Path(__file__).resolve().parent / "results"

# SmolLM2-135M's dimensions (its config.json), without the number of layers.
SMOLLM2_135M_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
)
# A tiny shape for the benchmarks' seconds-long smoke runs (`--quick`).
QUICK_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


# --- measuring ------------------------------------------------------------------------------------------------------

# Where and in what precision the models run; set once per run by `use_device`.
DEVICE = torch.device("cpu")
DTYPE = torch.float32


def choose_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """CUDA with bfloat16 where a CUDA device is present, else CPU with float32; either can be given explicitly."""
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = "bfloat16" if chosen.type == "cuda" else "float32"
    return chosen, getattr(torch, dtype)


def use_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """Run the models of this process on `choose_device(device, dtype)`; returns that device and dtype."""
    global DEVICE, DTYPE
    DEVICE, DTYPE = choose_device(device, dtype)
    return DEVICE, DTYPE


def synchronize():
    """Wait for the device's queued work, so that clocks read after a step include it."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


class GlibcAllocator:
    """Switch glibc's malloc between a setting for timing and one for measuring peak memory.

    Timing: blocks under 32 MiB come from the heap and are reused (glibc's own steady state once large blocks have
    been freed), so steps do not pay page faults for fresh memory. Peak memory: every block above 64 KiB gets its own
    mmap and goes back to the system when freed, so the process's resident size follows what a step allocates
    rather than what the allocator kept from before. No-ops where glibc is not the C library.
    """

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

    def __init__(self):
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None

    def for_timing(self):
        if self.libc is not None:
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 32 * 2**20)
            self.libc.mallopt(self.M_TRIM_THRESHOLD, 64 * 2**20)

    def for_memory(self):
        if self.libc is not None:
            self.libc.malloc_trim(0)
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 64 * 2**10)
            self.libc.mallopt(self.M_TRIM_THRESHOLD, 128 * 2**10)


ALLOCATOR = GlibcAllocator()


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1)) * 1024


def peak_memory_of(step) -> int | None:
    """Bytes the process's resident size (on CUDA: the device's allocated memory) rose above its level before
    `step()` at the step's peak (Linux only on CPU)."""
    if DEVICE.type == "cuda":
        synchronize()
        torch.cuda.reset_peak_memory_stats(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        step()
        synchronize()
        return torch.cuda.max_memory_allocated(DEVICE) - before
    ALLOCATOR.for_memory()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # reset the high-water mark (VmHWM) to the current resident size
        before = _proc_status_bytes("VmRSS")
        step()
        return _proc_status_bytes("VmHWM") - before
    except (OSError, AttributeError):
        step()
        return None
    finally:
        ALLOCATOR.for_timing()


def alternate(steps: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Time each step `repeats` times, alternating between them (and flipping the order every round).

    Records wall-clock seconds and the process's CPU seconds. On a machine shared with other jobs, the CPU time of a
    single-threaded run is the steadier measure of the work a step does: it does not count the time the thread
    waits for a core.
    """
    times = {name: {"wall": [], "cpu": []} for name in steps}
    names = list(steps)
    for round_idx in range(repeats):
        for name in names if round_idx % 2 == 0 else names[::-1]:
            synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            synchronize()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def forward_step(model, input_ids):
    def step():
        with torch.inference_mode():
            model(input_ids, use_cache=False)

    return step


def train_step(model, input_ids, position_ids=None):
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids, position_ids=position_ids, labels=input_ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def generation_step(model, prompt, decode_tokens, record):
    """Prefill `prompt` into a fresh cache, then decode `decode_tokens` greedy tokens one at a time."""

    def step():
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            synchronize()
            start = (time.perf_counter(), time.process_time())
            logits = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            synchronize()
            prefilled = (time.perf_counter(), time.process_time())
            next_token = logits[:, -1:].argmax(-1)
            for _ in range(decode_tokens):
                logits = model(next_token, past_key_values=cache, use_cache=True).logits
                next_token = logits[:, -1:].argmax(-1)
            synchronize()
            done = (time.perf_counter(), time.process_time())
        for clock, index in (("wall", 0), ("cpu", 1)):
            record.setdefault(f"prefill_{clock}_s", []).append(prefilled[index] - start[index])
            record.setdefault(f"decode_{clock}_s", []).append(done[index] - prefilled[index])
        record["kv_cache_bytes"] = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

    return step


def median(values):
    return statistics.median(values) if values else None


# --- models ---------------------------------------------------------------------------------------------------------


def base_model(shape: dict, num_layers: int, attn_implementation: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, num_hidden_layers=num_layers, attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).to(DEVICE, DTYPE).eval()


def converted_iha_model(base: LlamaForCausalLM, shape: dict, num_pseudo_heads: int, **iha_options):
    """The base model's weights in an IHA model (identity head mixing: what the converter produces)."""
    config = iha.IHAConfig(
        **shape,
        num_hidden_layers=base.config.num_hidden_layers,
        num_pseudo_heads=num_pseudo_heads,
        attn_implementation=base.config._attn_implementation,
        **iha_options,
    )
    model = iha.IHAForCausalLM(config).to(DEVICE, DTYPE).eval()
    result = model.load_state_dict(base.state_dict(), strict=False)
    if result.unexpected_keys or any(".head_mixing." not in key for key in result.missing_keys):
        raise RuntimeError(f"conversion mismatch: {result}")
    return model
