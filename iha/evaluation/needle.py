"""A RULER-style multi-key needle-in-a-haystack generator, with exact-match scoring, for any causal LM.

Each example hides `num_keys + num_distractors` needles ("The special magic number for <key> is: <value>.") at
random depths in a haystack of repeated filler sentences, sized so the whole prompt is about `context_length`
tokens. The question asks for the values of `num_keys` of the keys; the distractor needles carry other keys with
their own values (RULER's multi-key setting). Keys are distinct two-word names, values distinct random numbers of
`value_digits` digits.

Scoring (exact match, as in RULER's string match): a queried value counts as found when the exact digit string
appears in the answer as a whole number. `score` is the fraction of queried values found, `all_found` is 1 when all
of them are. Everything is deterministic in the seed: example `i` of seed `s` is the same whatever the number of
examples.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
    "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid", "wild", "young",
    "zesty", "bright", "crisp", "damp", "fierce", "golden",
)  # fmt: skip
NOUNS = (
    "anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchid", "pepper", "quarry", "river", "saddle", "tunnel", "umbrella", "valley",
    "walnut", "yarrow", "zephyr", "beacon", "castle", "desert", "forest", "glacier",
)  # fmt: skip
NEEDLE_TEMPLATE = "The special magic number for {key} is: {value}."
INTRODUCTION = (
    "A long text follows. Hidden in it are special magic numbers, each attached to a name. Remember them: "
    "you will be asked for some of them afterwards."
)
QUESTION_TEMPLATE = "What is the special magic number for {keys} in the text above?"
ANSWER_PREFIX = "The special magic number for {keys} is"


@dataclass
class NeedleConfig:
    context_length: int = 4096  # target prompt length in tokens (in words when no tokenizer is given)
    num_keys: int = 1  # keys asked about
    num_distractors: int = 3  # needles with other keys, not asked about
    num_examples: int = 50
    seed: int = 0
    value_digits: int = 7

    def __post_init__(self):
        if self.num_keys < 1:
            raise ValueError(f"`num_keys` must be >= 1, got {self.num_keys}.")
        if self.num_distractors < 0:
            raise ValueError(f"`num_distractors` must be >= 0, got {self.num_distractors}.")
        if self.num_keys + self.num_distractors > len(ADJECTIVES) * len(NOUNS):
            raise ValueError(f"At most {len(ADJECTIVES) * len(NOUNS)} needles per example.")
        if self.value_digits < 2:
            raise ValueError(f"`value_digits` must be >= 2, got {self.value_digits}.")
        if self.num_examples < 1:
            raise ValueError(f"`num_examples` must be >= 1, got {self.num_examples}.")
        if self.context_length < 1:
            raise ValueError(f"`context_length` must be >= 1, got {self.context_length}.")


@dataclass
class NeedleExample:
    prompt: str  # the full user message (introduction, haystack with needles, question)
    answer_prefix: str  # what the answer starts with (RULER appends it after the chat template)
    query_keys: list[str]
    expected_values: list[str]
    needles: dict[str, str]  # every key -> value in the text, distractors included
    depths: list[float]  # relative position (0..1) of each needle, in needle order
    num_tokens: int  # length of `prompt` in tokens (words without a tokenizer)


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def _length(text: str, tokenizer) -> int:
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _assemble(filler_sentences: list[str], needles: list[str], positions: list[int], query_keys: list[str]) -> str:
    sentences = list(filler_sentences)
    # Insert from the back so earlier insertion points stay valid.
    for position, needle in sorted(zip(positions, needles), key=lambda pair: -pair[0]):
        sentences.insert(position, needle)
    haystack = " ".join(sentences)
    return f"{INTRODUCTION}\n\n{haystack}\n\n{QUESTION_TEMPLATE.format(keys=_join_keys(query_keys))}"


def make_needle_example(config: NeedleConfig, index: int, tokenizer=None) -> NeedleExample:
    """Example `index` of the task described by `config` (deterministic in `config.seed` and `index`)."""
    rng = random.Random(f"needle-{config.seed}-{index}")
    num_needles = config.num_keys + config.num_distractors
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], num_needles)
    keys = [f"{adjective}-{noun}" for adjective, noun in pairs]
    low, high = 10 ** (config.value_digits - 1), 10**config.value_digits - 1
    values: list[str] = []
    while len(values) < num_needles:
        value = str(rng.randint(low, high))
        if value not in values:
            values.append(value)
    needles = [NEEDLE_TEMPLATE.format(key=key, value=value) for key, value in zip(keys, values)]
    query_keys = keys[: config.num_keys]
    rng.shuffle(needles)  # queried needles are not always first in the text
    filler_sentences = [sentence.strip() + "." for sentence in FILLER.split(".") if sentence.strip()]

    # Find the largest number of filler sentences whose prompt fits `context_length` (binary search: the
    # prompt length is monotone in the number of sentences).
    def build(count: int, positions: list[int]) -> str:
        haystack = [filler_sentences[i % len(filler_sentences)] for i in range(count)]
        return _assemble(haystack, needles, positions, query_keys)

    def fits(count: int) -> bool:
        return _length(build(count, [0] * num_needles), tokenizer) <= config.context_length

    if not fits(0):
        raise ValueError(
            f"`context_length` {config.context_length} is too short for {num_needles} needles and the question "
            f"({_length(build(0, [0] * num_needles), tokenizer)} tokens without any haystack): raise it."
        )
    low_count, high_count = 0, 1
    while fits(high_count):
        low_count, high_count = high_count, high_count * 2
    while high_count - low_count > 1:
        middle = (low_count + high_count) // 2
        low_count, high_count = (middle, high_count) if fits(middle) else (low_count, middle)
    count = low_count
    positions = sorted(rng.randint(0, count) for _ in range(num_needles))
    prompt = build(count, positions)
    depths = [position / max(count, 1) for position in positions]
    key_order = [re.search(r"for (\S+) is", needle).group(1) for needle in needles]
    return NeedleExample(
        prompt=prompt,
        answer_prefix=ANSWER_PREFIX.format(keys=_join_keys(query_keys)),
        query_keys=query_keys,
        expected_values=values[: config.num_keys],
        needles=dict(zip(keys, values)),
        depths=[depths[key_order.index(key)] for key in keys],
        num_tokens=_length(prompt, tokenizer),
    )


def make_needle_examples(config: NeedleConfig, tokenizer=None) -> list[NeedleExample]:
    return [make_needle_example(config, index, tokenizer) for index in range(config.num_examples)]


def score_needle_answer(answer: str, expected_values: Sequence[str]) -> float:
    """Fraction of `expected_values` that appear in `answer` as whole numbers (exact digits)."""
    found = set(re.findall(r"\d+", answer))
    return sum(value in found for value in expected_values) / len(expected_values)


GenerateFn = Callable[[list[NeedleExample]], list[str]]


def evaluate_needle_examples(
    examples: Sequence[NeedleExample], generate: GenerateFn, batch_size: int = 4, description: str = "needle"
) -> dict:
    """Score `generate` (examples -> answers) on `examples`: mean `score` and `all_found`, plus per-example rows."""
    rows = []
    bar = tqdm(total=len(examples), desc=description, unit="example")
    for start in range(0, len(examples), batch_size):
        batch = list(examples[start : start + batch_size])
        answers = generate(batch)
        bar.update(len(batch))
        if len(answers) != len(batch):
            raise ValueError(f"The generate function returned {len(answers)} answers for {len(batch)} examples.")
        for example, answer in zip(batch, answers):
            score = score_needle_answer(answer, example.expected_values)
            rows.append(
                {
                    "query_keys": example.query_keys,
                    "expected": example.expected_values,
                    "answer": answer,
                    "score": score,
                    "all_found": float(score == 1.0),
                    "num_tokens": example.num_tokens,
                }
            )
    bar.close()
    return {
        "score": sum(row["score"] for row in rows) / len(rows),
        "all_found": sum(row["all_found"] for row in rows) / len(rows),
        "examples": rows,
    }


def hf_needle_generate(model, tokenizer, max_new_tokens: int = 32, use_chat_template: bool = True) -> GenerateFn:
    """A greedy `generate` function for `evaluate_needle_examples` from a transformers causal LM.

    The prompt is the user message (chat-templated when the tokenizer has a template) followed by the answer
    prefix, so the model only has to continue with the number(s).
    """
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    )
    device = next(model.parameters()).device

    def render(example: NeedleExample) -> str:
        if use_chat_template and getattr(tokenizer, "chat_template", None) is not None:
            messages = [{"role": "user", "content": example.prompt}]
            head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return head + example.answer_prefix
        return f"{example.prompt}\n{example.answer_prefix}"

    @torch.no_grad()
    def generate(batch: list[NeedleExample]) -> list[str]:
        saved_padding_side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            encoded = tokenizer([render(e) for e in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tokenizer.padding_side = saved_padding_side
        encoded = {key: value.to(device) for key, value in encoded.items()}
        output = model.generate(
            **encoded, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos
        )
        return tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)

    return generate


def evaluate_needle(
    model,
    tokenizer,
    context_lengths: Sequence[int],
    num_keys: int = 1,
    num_distractors: int = 3,
    num_examples: int = 50,
    seed: int = 0,
    batch_size: int = 4,
    max_new_tokens: int = 32,
    model_name: str = "model",
    use_chat_template: bool = True,
) -> dict:
    """The needle task at each context length, greedy decoding; returns a JSON-ready result."""
    generate = hf_needle_generate(model, tokenizer, max_new_tokens, use_chat_template)
    by_length = []
    config = None
    for context_length in context_lengths:
        config = NeedleConfig(context_length, num_keys, num_distractors, num_examples, seed)
        examples = make_needle_examples(config, tokenizer)
        scored = evaluate_needle_examples(
            examples, generate, batch_size, description=f"{model_name} / needle {context_length} tokens"
        )
        by_length.append({"context_length": context_length, **scored})
    return {"model": model_name, "config": asdict(config), "by_length": by_length}


__all__ = [
    "NeedleConfig",
    "NeedleExample",
    "evaluate_needle",
    "evaluate_needle_examples",
    "hf_needle_generate",
    "make_needle_example",
    "make_needle_examples",
    "score_needle_answer",
]
