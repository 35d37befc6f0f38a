"""Speed and memory of IHA against the base Llama model with the same dimensions and weights, in one run.

    python benchmarks/bench_perf.py            # full run: writes benchmarks/results/perf.md and perf.json
    python benchmarks/bench_perf.py --quick    # seconds-long smoke run: benchmarks/results/perf_quick.{md,json}

The model is shaped like SmolLM2-135M (hidden 576, 9 heads, 3 KV heads, head dim 64, MLP 1536, vocabulary 49152,
tied embeddings) with fewer layers (`--layers`, 10 by default) to keep the run short. The base model is a random
`LlamaForCausalLM`; every IHA model is converted from its weights (same state dict, identity head mixing), so both
sides compute with the same parameters. Everything runs in float32. Base and IHA are timed alternately, every
measurement repeated (`--repeats`) and reported as the median, so that load from other processes falls on both.

For every sequence length N, number of pseudo-heads P and layout (every layer global IHA, or the paper's hybrid:
4 sliding IHA layers with window N / (2 P^2) to 1 global MHA layer) the report gives forward and forward + backward
time, prefill and decode speed, peak memory and KV-cache bytes, each next to the model FLOP ratio IHA / base
(`model_flops`: analytic counts of the matmul work). A second table decodes with 1024 tokens of context in both
cache modes (`iha_cache_mode="token"`, the default, and `"pseudo"`). A third table trains on packed rows, as TRL's
`--packing` sends them (`--packed DOCUMENTS LENGTH`: one row of DOCUMENTS documents of LENGTH tokens with restarting
position ids and no mask), and gives the ratio of every round with the median and spread. The targets are checked at
the end of the report.

The device and dtype come from the machine: on CPU float32 with one torch thread, timed in the process's CPU time;
on a CUDA device bfloat16 (`--dtype` to change it), timed in wall-clock time after synchronizing, with peak memory
from the CUDA allocator. `--attn-implementation` runs SDPA (default), flex attention or FlashAttention (FlashAttention
runs no sliding IHA layers, so it measures the global layout only).
"""

import ctypes
import json
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import iha  # noqa: E402
from iha.arguments import ArgumentParser  # noqa: E402
from iha.atomic_files import write_text_atomic  # noqa: E402
from iha.configuration_iha import is_iha_layer, is_sliding_layer  # noqa: E402


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

TARGETS = {
    "packed_train_time": 1.1,  # packed row of 4 x 512 tokens, global IHA, P=2: forward + backward <= 1.1 x base
    "forward_vs_flops": 1.15,  # global IHA, P=2, N=2048: forward time ratio <= 1.15 x FLOP ratio
    "hybrid_train_time": 1.2,  # hybrid, P=2, N=2048: forward + backward time <= 1.2 x base
    "decode_kv_bytes": 1.0,  # decode, P=2, global, 1024 context: KV bytes <= 1.0 x base (default cache mode)
    "decode_speed_vs_flops": 0.8,  # ... and decode tok/s ratio >= 0.8 x inverse decode-step FLOP ratio
}


# --- analytic FLOPs -------------------------------------------------------------------------------------------------


def attention_pairs(
    num_tokens: int,
    num_pseudo_heads: int = 1,
    mask_mode: str = "flat_causal",
    sliding_window: int | None = None,
    past_tokens: int = 0,
) -> int:
    """(query, key) pairs one attention head scores for `num_tokens` new tokens after `past_tokens` earlier ones.

    Queries and keys are pseudo-tokens (P per token; P = 1 is standard attention). Pseudo-token (n, p) sees the
    pseudo-tokens of the earlier tokens inside the window (the last `sliding_window` tokens, or all) and, of its own
    token, pseudo-tokens 0..p (flat causal) or all P (token causal).
    """
    pairs = 0
    for token in range(past_tokens, past_tokens + num_tokens):
        first_visible = 0 if sliding_window is None else max(0, token - sliding_window + 1)
        earlier_keys = (token - first_visible) * num_pseudo_heads
        if mask_mode == "flat_causal":
            own_token_pairs = num_pseudo_heads * (num_pseudo_heads + 1) // 2
        else:
            own_token_pairs = num_pseudo_heads * num_pseudo_heads
        pairs += num_pseudo_heads * earlier_keys + own_token_pairs
    return pairs


def model_flops(
    shape: dict,
    attention_types: list[str],
    num_tokens: int,
    past_tokens: int = 0,
    num_pseudo_heads: int = 1,
    sliding_window: int | None = None,
    mask_mode: str = "flat_causal",
    collapse_mode: str = "per_head",
    cache_mode: str = "token",
    logits_tokens: int | None = None,
) -> dict[str, int]:
    """Forward FLOPs (2 per multiply-add) of a Llama or IHA decoder on `num_tokens` new tokens after `past_tokens`.

    Counts the matmul work: q/k/v/o projections, attention (q.k scores and weights @ v over the pairs the mask
    allows: an ideal kernel skips the rest), IHA head mixing (queries of the new tokens; keys and values of every
    token the layer attends to in token cache mode, where each step re-mixes the cache, or of the new tokens only in
    pseudo cache mode), the collapse, the MLP and the LM head (`logits_tokens` rows, default all new tokens).
    Element-wise work (norms, RoPE, softmax, activations) is not counted. Attention types as in `IHAConfig`;
    a Llama model is all "full_attention".
    """
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    logits_tokens = num_tokens if logits_tokens is None else logits_tokens
    flops = {"projections": 0, "attention": 0, "mixing": 0, "mlp": 0, "lm_head": 0}
    for attention_type in attention_types:
        flops["projections"] += 2 * num_tokens * hidden * head_dim * (2 * heads + 2 * kv_heads)
        flops["mlp"] += 2 * num_tokens * 3 * hidden * shape["intermediate_size"]
        is_iha = is_iha_layer(attention_type)
        window = sliding_window if is_sliding_layer(attention_type) else None
        pseudo = num_pseudo_heads if is_iha else 1
        pairs = attention_pairs(num_tokens, pseudo, mask_mode if is_iha else "flat_causal", window, past_tokens)
        flops["attention"] += 2 * 2 * heads * head_dim * pairs
        if is_iha:
            if cache_mode == "pseudo" or past_tokens == 0:
                mixed_kv_tokens = num_tokens
            else:  # the cache holds the last `window - 1` tokens on sliding layers
                cached = past_tokens if window is None else min(past_tokens, window - 1)
                mixed_kv_tokens = cached + num_tokens
            flops["mixing"] += 2 * num_tokens * pseudo * heads * head_dim * heads
            flops["mixing"] += 2 * 2 * mixed_kv_tokens * pseudo * kv_heads * head_dim * kv_heads
            collapse_sources = 1 if collapse_mode == "per_head" else heads
            flops["mixing"] += 2 * num_tokens * pseudo * heads * head_dim * collapse_sources
    flops["lm_head"] = 2 * logits_tokens * hidden * shape["vocab_size"]
    flops["total"] = sum(flops.values())
    return flops


# --- measuring ------------------------------------------------------------------------------------------------------

# Where and in what precision the models run; set once by `main` from the machine (`choose_device`).
DEVICE = torch.device("cpu")
DTYPE = torch.float32


def choose_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """CUDA with bfloat16 where a CUDA device is present, else CPU with float32; either can be given explicitly."""
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = "bfloat16" if chosen.type == "cuda" else "float32"
    return chosen, getattr(torch, dtype)


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


# --- models ---------------------------------------------------------------------------------------------------------


def base_model(shape: dict, num_layers: int, attn_implementation: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, num_hidden_layers=num_layers, attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).to(DEVICE, DTYPE).eval()


def layout_options(layout: str, num_layers: int, num_pseudo_heads: int, seq_len: int) -> dict:
    if layout == "global":
        return {"attention_types": ["iha_full_attention"] * num_layers}
    return iha.paper_hybrid_layout(num_layers, num_pseudo_heads, training_length=seq_len)


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


# --- the run --------------------------------------------------------------------------------------------------------


def median(values):
    return statistics.median(values) if values else None


def measure_grid(args, shape, base, progress) -> list[dict]:
    rows = []
    for seq_len in args.seq_lens:
        input_ids = torch.randint(0, shape["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
        input_ids = input_ids.to(DEVICE)
        for layout in args.layouts:
            for num_pseudo in args.pseudo_heads:
                progress.set_description(f"N={seq_len} P={num_pseudo} {layout}")
                options = layout_options(layout, args.layers, num_pseudo, seq_len)
                model = converted_iha_model(base, shape, num_pseudo, iha_position_mode=args.position_mode, **options)
                models = {"base": base, "iha": model}
                row = {"layout": layout, "P": num_pseudo, "N": seq_len, "sliding_window": options.get("sliding_window")}
                row["attention_types"] = model.config.attention_types
                flop_kwargs = dict(num_pseudo_heads=num_pseudo, sliding_window=options.get("sliding_window"))
                base_types = ["full_attention"] * args.layers
                row["flops"] = {
                    "forward": {
                        "base": model_flops(shape, base_types, seq_len)["total"],
                        "iha": model_flops(shape, model.config.attention_types, seq_len, **flop_kwargs)["total"],
                    },
                    "decode_step": {
                        "base": model_flops(shape, base_types, 1, past_tokens=seq_len)["total"],
                        "iha": model_flops(shape, model.config.attention_types, 1, past_tokens=seq_len, **flop_kwargs)[
                            "total"
                        ],
                    },
                }
                # The memory runs double as warm-up.
                row["peak_memory_forward"] = {
                    name: peak_memory_of(forward_step(m, input_ids)) for name, m in models.items()
                }
                row["forward_s"] = alternate({n: forward_step(m, input_ids) for n, m in models.items()}, args.repeats)
                progress.update(1)
                row["peak_memory_train"] = {
                    name: peak_memory_of(train_step(m, input_ids)) for name, m in models.items()
                }
                row["train_s"] = alternate({n: train_step(m, input_ids) for n, m in models.items()}, args.repeats)
                progress.update(1)
                generation = {name: {} for name in models}
                steps = {n: generation_step(m, input_ids, args.decode_tokens, generation[n]) for n, m in models.items()}
                for step in steps.values():
                    step()  # warm-up
                for record in generation.values():
                    record.clear()
                alternate(steps, args.repeats)
                row["generation"] = generation
                progress.update(1)
                rows.append(row)
                del model, models
    return rows


def measure_decoding(args, shape, base, progress) -> list[dict]:
    rows = []
    context = args.decode_context
    prompt = torch.randint(0, shape["vocab_size"], (1, context), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(DEVICE)
    for layout in args.layouts:
        for num_pseudo in args.pseudo_heads:
            options = layout_options(layout, args.layers, num_pseudo, context)
            flop_kwargs = dict(num_pseudo_heads=num_pseudo, sliding_window=options.get("sliding_window"))
            for cache_mode in ("token", "pseudo"):
                progress.set_description(f"decode P={num_pseudo} {layout} {cache_mode}")
                model = converted_iha_model(
                    base,
                    shape,
                    num_pseudo,
                    iha_position_mode=args.position_mode,
                    iha_cache_mode=cache_mode,
                    **options,
                )
                generation = {"base": {}, "iha": {}}
                steps = {
                    name: generation_step(m, prompt, args.decode_tokens, generation[name])
                    for name, m in (("base", base), ("iha", model))
                }
                for step in steps.values():
                    step()
                for record in generation.values():
                    record.clear()
                alternate(steps, args.repeats)
                # FLOPs of the step in the middle of the decoded tokens.
                past = context + args.decode_tokens // 2
                flops = {
                    "base": model_flops(shape, ["full_attention"] * args.layers, 1, past_tokens=past)["total"],
                    "iha": model_flops(
                        shape, model.config.attention_types, 1, past_tokens=past, cache_mode=cache_mode, **flop_kwargs
                    )["total"],
                }
                rows.append(
                    {
                        "layout": layout,
                        "P": num_pseudo,
                        "cache_mode": cache_mode,
                        "context": context,
                        "sliding_window": options.get("sliding_window"),
                        "generation": generation,
                        "decode_step_flops": flops,
                    }
                )
                progress.update(1)
                del model
    return rows


def measure_packed(args, shape, base, progress) -> list[dict]:
    """Forward + backward on one packed row (restarting position ids, no mask), base and IHA alternating."""
    rows = []
    num_documents, document_len = args.packed
    seq_len = num_documents * document_len
    input_ids = torch.randint(0, shape["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(3))
    input_ids = input_ids.to(DEVICE)
    position_ids = torch.arange(document_len, device=DEVICE).repeat(num_documents)[None]
    for layout in args.layouts:
        for num_pseudo in args.pseudo_heads:
            progress.set_description(f"packed {num_documents}x{document_len} P={num_pseudo} {layout}")
            # The hybrid window follows the training length, the packed row's.
            options = layout_options(layout, args.layers, num_pseudo, seq_len)
            model = converted_iha_model(base, shape, num_pseudo, iha_position_mode=args.position_mode, **options)
            steps = {name: train_step(m, input_ids, position_ids) for name, m in (("base", base), ("iha", model))}
            for step in steps.values():
                step()  # warm-up
            times = alternate(steps, args.repeats)
            rows.append(
                {
                    "layout": layout,
                    "P": num_pseudo,
                    "documents": num_documents,
                    "document_len": document_len,
                    "sliding_window": options.get("sliding_window"),
                    "train_s": times,
                }
            )
            progress.update(1)
            del model
    return rows


# --- the report -----------------------------------------------------------------------------------------------------


def ratio(iha_value, base_value):
    return iha_value / base_value if iha_value is not None and base_value else None


def fmt(value, digits=2, suffix=""):
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def mib(value):
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def summarize(
    grid: list[dict], decoding: list[dict], decode_tokens: int, packed: list[dict] = (), clock: str = "cpu"
) -> dict:
    """Medians and ratios (IHA / base) per row, in CPU time and in wall-clock time; targets in the primary `clock`."""
    for row in grid:
        flops = row["flops"]
        generation = row["generation"]
        summary = {
            "forward_flop_ratio": ratio(flops["forward"]["iha"], flops["forward"]["base"]),
            "decode_flop_ratio": ratio(flops["decode_step"]["iha"], flops["decode_step"]["base"]),
            "kv_cache_bytes": {name: record["kv_cache_bytes"] for name, record in generation.items()},
        }
        for clock_name in ("cpu", "wall"):
            forward = {name: median(times[clock_name]) for name, times in row["forward_s"].items()}
            train = {name: median(times[clock_name]) for name, times in row["train_s"].items()}
            prefill = {
                name: row["N"] / median(record[f"prefill_{clock_name}_s"]) for name, record in generation.items()
            }
            decode = {
                name: decode_tokens / median(record[f"decode_{clock_name}_s"]) for name, record in generation.items()
            }
            summary[clock_name] = {
                "forward_ms": {name: value * 1e3 for name, value in forward.items()},
                "forward_time_ratio": ratio(forward["iha"], forward["base"]),
                "train_ms": {name: value * 1e3 for name, value in train.items()},
                "train_time_ratio": ratio(train["iha"], train["base"]),
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "decode_speed_ratio": ratio(decode["iha"], decode["base"]),
            }
        row["summary"] = summary
    for row in decoding:
        flop_ratio = ratio(row["decode_step_flops"]["iha"], row["decode_step_flops"]["base"])
        generation = row["generation"]
        kv = {name: record["kv_cache_bytes"] for name, record in generation.items()}
        summary = {
            "decode_flop_ratio": flop_ratio,
            "kv_cache_bytes": kv,
            "kv_bytes_ratio": ratio(kv["iha"], kv["base"]),
        }
        for clock_name in ("cpu", "wall"):
            decode = {
                name: decode_tokens / median(record[f"decode_{clock_name}_s"]) for name, record in generation.items()
            }
            summary[clock_name] = {
                "decode_tok_s": decode,
                "decode_speed_ratio": ratio(decode["iha"], decode["base"]),
                "speed_vs_inverse_flops": ratio(decode["iha"], decode["base"]) * flop_ratio,
            }
        row["summary"] = summary
    for row in packed:
        summary = {}
        for clock_name in ("cpu", "wall"):
            times = row["train_s"]
            by_round = [iha_s / base_s for iha_s, base_s in zip(times["iha"][clock_name], times["base"][clock_name])]
            summary[clock_name] = {
                "train_ms": {name: median(record[clock_name]) * 1e3 for name, record in times.items()},
                "ratio_by_round": by_round,
                "ratio_median": median(by_round),
                "ratio_min": min(by_round),
                "ratio_max": max(by_round),
            }
        row["summary"] = summary
    return check_targets(grid, decoding, packed, clock)


def check_targets(grid: list[dict], decoding: list[dict], packed: list[dict] = (), clock: str = "cpu") -> dict:
    def find(rows, **where):
        return next((row for row in rows if all(row.get(k) == v for k, v in where.items())), None)

    other_clock = "wall" if clock == "cpu" else "cpu"
    results = {}
    row = find(packed, layout="global", P=2, documents=4, document_len=512)
    if row:
        primary, other = row["summary"][clock], row["summary"][other_clock]
        results["packed"] = {
            "target": "packed row of 4 x 512 tokens, every layer global IHA, P = 2, forward + backward: time <= 1.1 x "
            "base",
            "measured": f"{primary['ratio_median']:.2f} x base (median of {len(primary['ratio_by_round'])} rounds, "
            f"range {primary['ratio_min']:.2f} to {primary['ratio_max']:.2f}; {other_clock} "
            f"{other['ratio_median']:.2f} x)",
            "met": primary["ratio_median"] <= TARGETS["packed_train_time"],
        }
    row = find(grid, layout="global", P=2, N=2048)
    if row:
        flop_ratio = row["summary"]["forward_flop_ratio"]
        time_ratio = row["summary"][clock]["forward_time_ratio"]
        wall_ratio = row["summary"][other_clock]["forward_time_ratio"]
        results["1"] = {
            "target": "every layer global IHA, P = 2, N = 2048, forward: time ratio <= 1.15 x FLOP ratio",
            "measured": f"time ratio {time_ratio:.2f} ({other_clock} {wall_ratio:.2f}), FLOP ratio {flop_ratio:.2f}: "
            f"{time_ratio / flop_ratio:.2f} x the FLOP ratio ({other_clock} {wall_ratio / flop_ratio:.2f} x)",
            "met": time_ratio / flop_ratio <= TARGETS["forward_vs_flops"],
        }
    row = find(grid, layout="hybrid", P=2, N=2048)
    if row:
        time_ratio = row["summary"][clock]["train_time_ratio"]
        wall_ratio = row["summary"][other_clock]["train_time_ratio"]
        results["2"] = {
            "target": "paper's hybrid layout, P = 2, N = 2048, forward + backward: time <= 1.2 x base",
            "measured": f"{time_ratio:.2f} x base ({other_clock} {wall_ratio:.2f} x)",
            "met": time_ratio <= TARGETS["hybrid_train_time"],
        }
    row = find(decoding, layout="global", P=2, cache_mode="token", context=1024)
    if row:
        s = row["summary"]
        speed = s[clock]["speed_vs_inverse_flops"]
        results["3"] = {
            "target": "decoding, P = 2, every layer global IHA, 1024 tokens of context, default (token) cache mode: "
            "KV bytes <= 1.0 x base and tok/s ratio >= 0.8 x inverse decode-step FLOP ratio",
            "measured": f"KV bytes {s['kv_bytes_ratio']:.2f} x base; tok/s ratio {s[clock]['decode_speed_ratio']:.2f} "
            f"({other_clock} {s[other_clock]['decode_speed_ratio']:.2f}), inverse FLOP ratio "
            f"{1 / s['decode_flop_ratio']:.2f}: {speed:.2f} x ({other_clock} "
            f"{s[other_clock]['speed_vs_inverse_flops']:.2f} x)",
            "met": s["kv_bytes_ratio"] <= TARGETS["decode_kv_bytes"] and speed >= TARGETS["decode_speed_vs_flops"],
        }
        pseudo_row = find(decoding, layout="global", P=2, cache_mode="pseudo", context=1024)
        if pseudo_row:
            # Stricter reading: the FLOPs of the cheapest decode step (pseudo mode, no re-mixing) as the yardstick.
            minimal_flop_ratio = pseudo_row["summary"]["decode_flop_ratio"]
            results["3"]["measured"] += (
                f"; against the FLOPs of a step without re-mixing (ratio {minimal_flop_ratio:.2f}): "
                f"{s[clock]['decode_speed_ratio'] * minimal_flop_ratio:.2f} x"
            )
    return results


def markdown_report(meta: dict, grid: list[dict], decoding: list[dict], targets: dict, packed: list[dict] = ()) -> str:
    clock = meta.get("clock", "cpu")
    other_clock = "wall" if clock == "cpu" else "cpu"
    clock_text = {"cpu": "CPU time", "wall": "wall-clock time"}
    lines = [
        "# IHA vs base Llama: speed and memory",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}; {meta['threads']} torch thread(s); {meta.get('dtype', 'float32')} on "
        f"{meta.get('device', 'cpu')}, attention `{meta.get('attn_implementation', 'sdpa')}`.  ",
        f"Model: {meta['shape_name']} ({meta['shape_note']}) with **{meta['layers']} layers**, random weights; the "
        "IHA model is converted from the base model's weights. IHA options: "
        f"`iha_position_mode={meta['position_mode']!r}`, flat causal mask, per-head collapse. "
        f"Hybrid layout = the paper's 4 sliding IHA : 1 global MHA (layers {meta['global_layers_note']}), window "
        "W = N / (2 P^2) tokens.  ",
        f"Times: medians of {meta['repeats']} runs, base and IHA alternating, in **{clock_text[clock]}** "
        f"({clock_text[other_clock]} ratios in parentheses; all raw times in the JSON). {meta['machine_note']}",
        "",
        "Ratios are IHA / base. FLOP ratios come from `model_flops` (matmul work of an ideal kernel: attention counts "
        "only the (query, key) pairs the mask allows; the LM head is "
        f"{meta['lm_head_share']} of the base model's forward FLOPs at N = {meta['lm_head_share_at']}). A time ratio "
        "close to the FLOP ratio means the IHA kernels waste little. Prefill: the N-token prompt into an empty cache "
        f"(last logits only); decode: {meta['decode_tokens']} greedy tokens after it (batch 1). Peak memory: rise of "
        "the process's resident memory during one step, above the loaded model. KV cache: after prefill + decode.",
    ]
    if grid:
        lines += [
            "",
            "| layout | P | N | forward ms base / IHA | time ratio | FLOP ratio | fwd+bwd ms base / IHA | time ratio "
            "| prefill tok/s base / IHA | decode tok/s base / IHA | decode ratio | decode FLOP ratio "
            "| peak MiB fwd base / IHA | peak MiB fwd+bwd base / IHA | KV cache MiB base / IHA |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for row in grid:
        s, cpu, wall = row["summary"], row["summary"][clock], row["summary"][other_clock]
        layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
        lines.append(
            f"| {layout} | {row['P']} | {row['N']} "
            f"| {cpu['forward_ms']['base']:.0f} / {cpu['forward_ms']['iha']:.0f} "
            f"| {fmt(cpu['forward_time_ratio'])} ({fmt(wall['forward_time_ratio'])}) | {fmt(s['forward_flop_ratio'])} "
            f"| {cpu['train_ms']['base']:.0f} / {cpu['train_ms']['iha']:.0f} "
            f"| {fmt(cpu['train_time_ratio'])} ({fmt(wall['train_time_ratio'])}) "
            f"| {cpu['prefill_tok_s']['base']:.0f} / {cpu['prefill_tok_s']['iha']:.0f} "
            f"| {cpu['decode_tok_s']['base']:.1f} / {cpu['decode_tok_s']['iha']:.1f} "
            f"| {fmt(cpu['decode_speed_ratio'])} ({fmt(wall['decode_speed_ratio'])}) | {fmt(s['decode_flop_ratio'])} "
            f"| {mib(row['peak_memory_forward']['base'])} / {mib(row['peak_memory_forward']['iha'])} "
            f"| {mib(row['peak_memory_train']['base'])} / {mib(row['peak_memory_train']['iha'])} "
            f"| {mib(s['kv_cache_bytes']['base'])} / {mib(s['kv_cache_bytes']['iha'])} |"
        )
    if decoding:
        lines += [
            "",
            f"## Decoding with {meta['decode_context']} tokens of context: the two cache modes",
            "",
            '`iha_cache_mode="token"` (default) caches the un-mixed keys and values (the base model\'s memory) and '
            're-mixes them every step; `"pseudo"` caches the mixed pseudo keys and values (P x the memory on IHA layers) '
            "and mixes only the new token. The decode-step FLOP ratio counts each mode's own work (token mode includes "
            "the re-mixing); `speed / inverse FLOPs` = (tok/s ratio) x (FLOP ratio): 1.0 means IHA decodes exactly as "
            "much slower as its FLOPs say, more means its extra work runs more efficiently than the base model's.",
            "",
            "| layout | P | cache mode | decode tok/s base / IHA | tok/s ratio | decode-step FLOP ratio "
            "| speed / inverse FLOPs | KV cache MiB base / IHA | KV ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for row in decoding:
        s, cpu, wall = row["summary"], row["summary"][clock], row["summary"][other_clock]
        layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
        lines.append(
            f"| {layout} | {row['P']} | {row['cache_mode']} "
            f"| {cpu['decode_tok_s']['base']:.1f} / {cpu['decode_tok_s']['iha']:.1f} "
            f"| {fmt(cpu['decode_speed_ratio'])} ({fmt(wall['decode_speed_ratio'])}) | {fmt(s['decode_flop_ratio'])} "
            f"| {fmt(cpu['speed_vs_inverse_flops'])} ({fmt(wall['speed_vs_inverse_flops'])}) "
            f"| {mib(s['kv_cache_bytes']['base'])} / {mib(s['kv_cache_bytes']['iha'])} | {fmt(s['kv_bytes_ratio'])} |"
        )
    if packed:
        lines += [
            "",
            "## Training on packed rows",
            "",
            "One row of documents with restarting position ids and no attention mask (what TRL's `--packing` sends), "
            "forward + backward. IHA layers attend within each document (per document on SDPA); the base model's "
            "SDPA runs over the row with the documents' block-diagonal mask. Ratio of every round (base and IHA timed "
            "back to back, the order flipped each round), their median and range.",
            "",
            f"| layout | P | row | fwd+bwd ms base / IHA | ratio median | range | by round | {other_clock} ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in packed:
            primary, other = row["summary"][clock], row["summary"][other_clock]
            layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
            lines.append(
                f"| {layout} | {row['P']} | {row['documents']} x {row['document_len']} "
                f"| {primary['train_ms']['base']:.0f} / {primary['train_ms']['iha']:.0f} "
                f"| **{primary['ratio_median']:.3f}** | {primary['ratio_min']:.3f} - {primary['ratio_max']:.3f} "
                f"| {', '.join(f'{value:.3f}' for value in primary['ratio_by_round'])} "
                f"| {other['ratio_median']:.3f} |"
            )
    lines += ["", f"## Targets ({clock_text[clock]} ratios; {clock_text[other_clock]} in parentheses)", ""]
    if not targets:
        lines.append("(not evaluated in this run: the grid does not contain the targets' settings)")
    for number, target in targets.items():
        verdict = "**met**" if target["met"] else "**not met**"
        lines.append(f"{number}. {target['target']}: {target['measured']} -> {verdict}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths: a seconds-long smoke run")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--pseudo-heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["global", "hybrid"], choices=["global", "hybrid"])
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--position-mode", default="virtual", choices=["virtual", "shared"])
    parser.add_argument(
        "--packed",
        type=int,
        nargs=2,
        default=[4, 512],
        metavar=("DOCUMENTS", "LENGTH"),
        help="packed-row table: one row of DOCUMENTS documents of LENGTH tokens each",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["grid", "decoding", "packed"],
        choices=["grid", "decoding", "packed"],
        help="tables to measure (default all)",
    )
    parser.add_argument("--name", help="report file names NAME.md and NAME.json (default perf, or perf_quick)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda where present)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "eager"],
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a machine shared with other jobs, every parallel op of a 2-thread run "
        "waits for a second free core, which swamps the timings)",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", type=Path, help="rewrite the report from this JSON of an earlier run, no measuring")
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.seq_lens, args.pseudo_heads = 5, [64, 128], [2]
        args.decode_context, args.decode_tokens, args.repeats, args.packed = 64, 4, 1, [2, 64]
    if args.attn_implementation.startswith("flash") and "hybrid" in args.layouts:
        # IHA refuses FlashAttention for sliding IHA layers (its window counts virtual tokens).
        print("FlashAttention runs no sliding IHA layers: measuring the global layout only.")
        args.layouts = [layout for layout in args.layouts if layout != "hybrid"] or ["global"]
    if min(args.packed) < 1:
        parser.error("--packed needs at least 1 document of at least 1 token")
    if args.layers < 1 or args.repeats < 1 or args.decode_tokens < 1:
        parser.error("--layers, --repeats and --decode-tokens must be at least 1")
    return args


def render(json_path: Path):
    """Rewrite the markdown report next to `json_path` from its measurements (no measuring)."""
    payload = json.loads(json_path.read_text())
    packed = payload.get("packed", [])
    meta = payload["meta"]
    targets = summarize(payload["grid"], payload["decoding"], meta["decode_tokens"], packed, meta.get("clock", "cpu"))
    payload["targets"] = targets
    write_text_atomic(json.dumps(payload, indent=1, default=str), json_path)
    report = markdown_report(meta, payload["grid"], payload["decoding"], targets, packed)
    write_text_atomic(report, json_path.with_suffix(".md"))
    print(report)


def main(argv=None):
    args = parse_args(argv)
    if args.render is not None:
        return render(args.render)
    global DEVICE, DTYPE
    DEVICE, DTYPE = choose_device(args.device, args.dtype)
    # CPU time measures a CPU run's own work on a shared machine; on a GPU it measures only the host's launches.
    clock = "wall" if DEVICE.type == "cuda" else "cpu"
    ALLOCATOR.for_timing()
    if DEVICE.type == "cpu":
        torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    base = base_model(shape, args.layers, args.attn_implementation)
    load_at_start = os.getloadavg()[0]

    per_layout = len(args.layouts) * len(args.pseudo_heads)
    total = {"grid": 3 * len(args.seq_lens) * per_layout, "decoding": 2 * per_layout, "packed": per_layout}
    with tqdm(total=sum(total[section] for section in args.sections), unit="measurement") as progress:
        grid = measure_grid(args, shape, base, progress) if "grid" in args.sections else []
        decoding = measure_decoding(args, shape, base, progress) if "decoding" in args.sections else []
        packed = measure_packed(args, shape, base, progress) if "packed" in args.sections else []
    targets = summarize(grid, decoding, args.decode_tokens, packed, clock)

    n_ref = 2048 if 2048 in args.seq_lens else max(args.seq_lens)
    base_flops = model_flops(shape, ["full_attention"] * args.layers, n_ref)
    hybrid_types = iha.paper_hybrid_layout(args.layers, 2, 64)["attention_types"]
    hybrid_globals = [i for i, attention_type in enumerate(hybrid_types) if attention_type == "full_attention"]
    meta = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "device": str(DEVICE) if DEVICE.type == "cpu" else f"{DEVICE} ({torch.cuda.get_device_name(DEVICE)})",
        "dtype": str(DTYPE).removeprefix("torch."),
        "attn_implementation": args.attn_implementation,
        "clock": clock,
        "layers": args.layers,
        "shape_note": ", ".join(f"{k} {v}" for k, v in shape.items() if k != "rope_parameters"),
        "position_mode": args.position_mode,
        "global_layers_note": ", ".join(str(i) for i in hybrid_globals) + " global",
        "repeats": args.repeats,
        "machine_note": (
            f"Load average (1 min) {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end of the run "
            f"on {os.cpu_count()} cores. {args.machine_note}"
        ).strip(),
        "decode_tokens": args.decode_tokens,
        "decode_context": args.decode_context,
        "lm_head_share": f"{base_flops['lm_head'] / base_flops['total']:.0%}",
        "lm_head_share_at": n_ref,
        "shape_name": "a tiny smoke-test shape" if args.quick else "SmolLM2-135M's shape (30 layers in the original)",
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("perf_quick" if args.quick else "perf")
    report = markdown_report(meta, grid, decoding, targets, packed)
    write_text_atomic(report, args.output_dir / f"{stem}.md")
    payload = {"meta": meta, "grid": grid, "decoding": decoding, "packed": packed, "targets": targets}
    write_text_atomic(json.dumps(payload, indent=1, default=str), args.output_dir / f"{stem}.json")
    print(report)
    print(f"wrote {args.output_dir / f'{stem}.md'} and {stem}.json")


if __name__ == "__main__":
    main()
