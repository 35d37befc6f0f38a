"""Verification: the source and the converted model run in fp32 on a fixed batch (and, for settings that change the
function, on one long input), one model in memory at a time, and their logits are compared."""

import ctypes
import gc
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..data.word_problems import arithmetic_word_problems
from ..models.iha.configuration_iha import IHAConfig
from .errors import ConversionError
from .options import EXACT_ATOL, NOISE_MULTIPLE
from .plan import iha_attention_windows, iha_causal_lm_class


VERIFICATION_PROMPTS = (
    "What is the capital of France?",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?",
    "Write a short poem about the sea.",
)
RANDOM_VERIFICATION_LENGTHS = (48, 37, 20)
# Settings that change the function are also measured on one long input of this many tokens, or twice the smallest
# window they change if that is longer (the change starts past the window); at most the model's positions and
# MAX_LONG_VERIFICATION_TOKENS (the logits of a long input take length x vocabulary floats, twice).
LONG_VERIFICATION_TOKENS = 512
MAX_LONG_VERIFICATION_TOKENS = 4096


@dataclass
class VerificationResult:
    max_abs_diff: float
    top1_agreement: float
    positions: int
    batch_shape: list[int]
    reference_noise: float  # the source's own fp32 rounding noise: its logits with sdpa vs eager attention
    tolerance: float | None  # None when the settings are not meant to be exact
    exact_expected: bool
    passed: bool
    message: str
    # The same figures for each input (and, for the long input, each half or each side of the window): where a
    # change that depends on the length shows, and where it does not.
    by_length: list[dict] = field(default_factory=list)


def verification_batch(tokenizer, vocab_size: int) -> dict[str, torch.Tensor]:
    """A fixed, left-padded batch: chat prompts when there is a tokenizer, seeded random tokens otherwise."""
    if tokenizer is not None:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is not None:
            if tokenizer.chat_template:
                texts = [
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                    )
                    for prompt in VERIFICATION_PROMPTS
                ]
            else:
                texts = list(VERIFICATION_PROMPTS)
            encoded = tokenizer(
                texts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template
            )
            if int(encoded["input_ids"].max()) < vocab_size:
                return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    generator = torch.Generator().manual_seed(0)
    length = max(RANDOM_VERIFICATION_LENGTHS)
    input_ids = torch.randint(0, vocab_size, (len(RANDOM_VERIFICATION_LENGTHS), length), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, row_length in enumerate(RANDOM_VERIFICATION_LENGTHS):
        attention_mask[row, length - row_length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def long_verification_input(tokenizer, vocab_size: int, length: int) -> dict[str, torch.Tensor]:
    """One unpadded sequence of exactly `length` tokens: a chat of the package's own arithmetic word problems with
    their worked answers (ordinary text) when there is a tokenizer, seeded random tokens otherwise."""

    if tokenizer is not None:
        count = 8
        while True:
            problems = arithmetic_word_problems(count, seed=0)
            if tokenizer.chat_template:
                messages = []
                for problem in problems:
                    messages += [
                        {"role": "user", "content": problem["question"]},
                        {"role": "assistant", "content": problem["answer"]},
                    ]
                text = tokenizer.apply_chat_template(messages, tokenize=False)
            else:
                text = "\n\n".join(f"Question: {p['question']}\nAnswer: {p['answer']}" for p in problems)
            input_ids = tokenizer(text, add_special_tokens=not tokenizer.chat_template)["input_ids"]
            if len(input_ids) >= length or count >= 64 * length:
                break
            count *= 2
        if len(input_ids) >= length and max(input_ids[:length]) < vocab_size:
            input_ids = torch.tensor([input_ids[:length]])
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (1, length), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def long_verification_plan(config: IHAConfig, source_windows: Sequence[int | None]) -> tuple[int, int | None]:
    """(length of the long verification input, the smallest window the settings change or None).

    A changed window changes the outputs of tokens past it only, so the input is at least twice that window;
    other changes (positions, collapse, dtype) show at every token and grow with distance. See
    LONG_VERIFICATION_TOKENS and MAX_LONG_VERIFICATION_TOKENS for the bounds.
    """
    changed = [
        window
        for before, after in zip(source_windows, iha_attention_windows(config))
        if before != after
        for window in (before, after)
        if window is not None
    ]
    window = min(changed) if changed else None
    wanted = max(2 * window, LONG_VERIFICATION_TOKENS) if window is not None else LONG_VERIFICATION_TOKENS
    return min(wanted, config.max_position_embeddings, MAX_LONG_VERIFICATION_TOKENS), window


def compared_figures(source_logits: torch.Tensor, converted_logits: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference|, top-1 agreement) over the rows (positions) of two [positions, vocab] tensors."""
    top1 = float((converted_logits.argmax(-1) == source_logits.argmax(-1)).float().mean())
    return float((converted_logits - source_logits).abs().max()), top1


def logits_of_real_tokens(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[real tokens, vocab] logits: the LM head runs on non-padding positions only (a vocab-wide logits tensor
    for the padding too would be the largest allocation of the verification)."""
    hidden_states = model.base_model(**batch).last_hidden_state
    return model.get_output_embeddings()(hidden_states[batch["attention_mask"].bool()])


def release_memory() -> None:
    """Free a model before loading the next one: collect it, hand freed heap back to the OS (glibc keeps it
    otherwise) and empty CUDA's cache, so the peak is one model, not one model plus the last one's leftovers
    (here and between the runs of `python -m research.ab`)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def verify_conversion(
    source_dir: str | os.PathLike,
    converted_dir: str | os.PathLike,
    *,
    exact_expected: bool = True,
    tolerance: float | None = None,
    long_length: int | None = None,
    window: int | None = None,
) -> VerificationResult:
    """Run the source and the converted model in fp32 on a fixed batch and compare the logits.

    The models run one after the other, so memory holds one model at a time. Only non-padding positions count.
    Exact settings pass when the largest logit difference is at most `tolerance`; by default that is
    `max(1e-5, 4 x the source's own rounding noise)`, the noise being how far the source's logits move when
    only its attention kernel changes (sdpa vs eager). A 2-layer model gets 1e-5; a 30-layer one like SmolLM2
    differs from itself by about 1e-4 under that change, and any other summation order (IHA's included) lands
    at the same level in fp32, however exact the function.
    Settings that change the function pass when the logits are finite: the result measures the change. With
    `long_length`, the models also run on one input of that many tokens, whose figures are reported for the
    tokens up to and past `window` (the smallest window the settings change), or for each half when no window
    changes: a window change shows only past the window, where the short batch never reaches.
    """

    source_dir, converted_dir = Path(source_dir), Path(converted_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    except Exception:  # no or unusable tokenizer: random tokens still verify the weights
        tokenizer = None
    converted_config = json.loads((converted_dir / "config.json").read_text())
    vocab_size = converted_config["vocab_size"]
    batch = verification_batch(tokenizer, vocab_size)
    long_input = long_verification_input(tokenizer, vocab_size, long_length) if long_length else None
    del tokenizer
    release_memory()

    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    valid = batch["attention_mask"].bool()
    source_logits = logits_of_real_tokens(source, batch)
    source_long_logits = logits_of_real_tokens(source, long_input) if long_input is not None else None
    other_implementation = "eager" if source.config._attn_implementation != "eager" else "sdpa"
    source.set_attn_implementation(other_implementation)
    # In place: a second logits-sized temporary would be the verification's largest allocation after the model.
    reference_noise = float(logits_of_real_tokens(source, batch).sub_(source_logits).abs_().max())
    if not math.isfinite(reference_noise):  # the other kernel failed on this input: fall back to the fixed bar
        reference_noise = 0.0
    del source
    release_memory()

    converted, loading_info = iha_causal_lm_class(converted_config["model_type"]).from_pretrained(
        converted_dir, dtype=torch.float32, output_loading_info=True
    )
    if any(loading_info.values()):
        raise ConversionError(f"The converted checkpoint does not load cleanly: {loading_info}.")
    converted.eval()
    converted_logits = logits_of_real_tokens(converted, batch)
    converted_long_logits = logits_of_real_tokens(converted, long_input) if long_input is not None else None
    del converted
    release_memory()

    lengths = batch["attention_mask"].sum(-1)
    by_length = [
        {
            "input": f"{len(lengths)} prompts of {int(lengths.min())}-{int(lengths.max())} tokens",
            "tokens": f"1-{int(lengths.max())}",
            "positions": int(valid.sum()),
            **dict(zip(("max_abs_diff", "top1_agreement"), compared_figures(source_logits, converted_logits))),
        }
    ]
    if long_input is not None:
        split = window if window is not None and window < long_length else long_length // 2
        for first, last, where in (
            (1, split, f"up to the {window}-token window" if window is not None else "first half"),
            (split + 1, long_length, f"past the {window}-token window" if window is not None else "second half"),
        ):
            if window is not None and window >= long_length and first > 1:
                continue  # the model's positions end before the window: nothing lies past it
            figures = compared_figures(source_long_logits[first - 1 : last], converted_long_logits[first - 1 : last])
            by_length.append(
                {
                    "input": f"one {long_length}-token text, {where}",
                    "tokens": f"{first}-{last}",
                    "positions": last - first + 1,
                    **dict(zip(("max_abs_diff", "top1_agreement"), figures)),
                }
            )
        converted_logits = torch.cat([converted_logits, converted_long_logits])
        source_logits = torch.cat([source_logits, source_long_logits])
        del converted_long_logits, source_long_logits

    positions = converted_logits.shape[0]
    top1_agreement = float((converted_logits.argmax(-1) == source_logits.argmax(-1)).float().mean())
    finite = bool(torch.isfinite(converted_logits).all())
    difference = converted_logits.sub_(source_logits).abs_().amax(dim=-1)  # per position
    max_abs_diff = float(difference.max())
    figures = (
        f"max |logit difference| {max_abs_diff:.2e} over {positions} positions, top-1 agreement "
        f"{100 * top1_agreement:.2f}% (the source against itself, sdpa vs eager: {reference_noise:.2e})"
    )
    if long_input is not None:
        figures += "; by input length: " + "; ".join(
            f"{entry['input']} (tokens {entry['tokens']}): {entry['max_abs_diff']:.2e}, top-1 "
            f"{100 * entry['top1_agreement']:.2f}%"
            for entry in by_length
        )
        if window is not None and window >= long_length:
            figures += (
                f"; the {window}-token window is not shorter than the longest input the model takes here "
                f"({long_length} tokens), so its change is not measured"
            )
    if exact_expected:
        if tolerance is None:
            tolerance = max(EXACT_ATOL, NOISE_MULTIPLE * reference_noise)
        passed = finite and max_abs_diff <= tolerance
        if passed:
            message = f"exact: {figures}, within the tolerance {tolerance:.1e}"
        else:
            worst = int(difference.argmax())
            if worst < int(valid.sum()):
                row, token = valid.nonzero()[worst].tolist()
                where = f"batch row {row}, token {token}"
            else:
                where = f"token {worst - int(valid.sum())} of the {long_length}-token input"
            message = (
                f"NOT exact: {figures} exceeds the tolerance {tolerance:.1e}; the largest difference is at {where}"
            )
    else:
        passed = finite
        message = (
            f"changed as intended: {figures}" if finite else f"the converted model gives non-finite logits: {figures}"
        )
    return VerificationResult(
        max_abs_diff=max_abs_diff,
        top1_agreement=top1_agreement,
        positions=positions,
        batch_shape=list(batch["input_ids"].shape),
        reference_noise=reference_noise,
        tolerance=tolerance if exact_expected else None,
        exact_expected=exact_expected,
        passed=passed,
        message=message,
        by_length=by_length,
    )
