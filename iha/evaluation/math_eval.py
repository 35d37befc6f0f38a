"""Zero-shot math evaluation (GSM8K, MATH-500): sampled generations, pass@1 and majority-vote accuracy.

Protocol: every problem is asked once as a chat turn ("...put your final answer within \\boxed{}"), the model
samples `num_samples` completions, the final answer of each is extracted and checked with math-verify
(`iha.evaluation.answers`). Reported:

* `pass@1`: mean over problems of the fraction of correct samples (the unbiased pass@1 estimate from n samples);
* `maj@k`: mean over problems of whether the majority-vote answer (k = num_samples, ties to the earliest answer)
  is correct;
* `no_answer_rate`: fraction of samples with no extractable/parseable answer.

The paper's protocol is the `paper` preset: temperature 0.6, 16 samples.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig, set_seed

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..data.messages import local_data_path, read_jsonl
from .answers import majority_vote, parse_answer, parsed_equivalent, read_answer
from .settings import BENCHMARKS, PRESETS, BenchmarkSpec, SamplingConfig, sampling_preset


DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Problem:
    id: str
    question: str
    gold: str


def _infer_benchmark(columns: Sequence[str], source: str) -> str:
    if "problem" in columns and "answer" in columns:
        return "math500"
    if "question" in columns and "answer" in columns:
        return "gsm8k"
    raise ValueError(
        f"Cannot tell the format of {source}: columns {sorted(columns)}. Expected GSM8K rows "
        "({'question', 'answer' ending in '#### N'}) or MATH-500 rows ({'problem', 'answer', ...}); "
        "pass `benchmark='gsm8k'` or `'math500'` if the columns have these names."
    )


def _read_local_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"{path} is not valid JSON ({error}).") from None
        if isinstance(data, dict) and "data" in data:
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of rows (or {{'data': [...]}}).")
        return data
    raise ValueError(f"{path}: only .jsonl and .json files are read; convert it or pass a Hub dataset id.")


def load_problems(
    source: str,
    benchmark: str | None = None,
    split: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Load math problems from a benchmark name (`gsm8k`, `math500`: from the Hub), a Hub id, or a local file.

    `benchmark` fixes the row format (`gsm8k` or `math500`); it is inferred from the columns when omitted.
    `limit` keeps the first `limit` problems.
    """
    if benchmark is not None and benchmark not in BENCHMARKS:
        raise ValueError(f"Unknown benchmark {benchmark!r}: choose one of {sorted(BENCHMARKS)}.")
    path = local_data_path(source)
    if path is not None and path.is_file():
        rows = _read_local_rows(path)
    elif path is not None:
        raise ValueError(f"{source} is a folder: give the .json / .jsonl file of the problems in it.")
    elif source in BENCHMARKS or source.count("/") == 1:
        # A benchmark's short name or its Hub id: either way the Hub config it needs (`openai/gsm8k` has "main").
        spec = BENCHMARKS.get(source) or next((spec for spec in BENCHMARKS.values() if spec.hub_id == source), None)
        hub_id = spec.hub_id if spec else source
        hub_config = spec.hub_config if spec else None
        benchmark = benchmark or (spec.name if spec else None)
        from datasets import load_dataset

        try:
            dataset = load_dataset(hub_id, hub_config, split=split or (spec.split if spec else "test"))
        except Exception as error:  # offline, unknown id, ...: the data named is not found from here (exit 2)
            raise FileNotFoundError(
                f"Could not load {hub_id!r} from the Hugging Face Hub ({type(error).__name__}: {error}). "
                "Offline, pass a local .jsonl file with the same columns instead (--dataset gsm8k=FILE.jsonl)."
            ) from error
        rows = list(dataset)
    else:
        raise FileNotFoundError(
            f"{source!r} is neither a file, a known benchmark ({sorted(BENCHMARKS)}) nor a Hub id (owner/name)."
        )
    if not rows:
        raise ValueError(f"{source} has no rows.")
    benchmark = benchmark or _infer_benchmark(list(rows[0]), source)
    spec = BENCHMARKS[benchmark]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"`limit` must be >= 1, got {limit}.")
        rows = rows[:limit]
    problems = []
    for index, row in enumerate(rows):
        if spec.question_column not in row:
            raise ValueError(f"{source} row {index} has no {spec.question_column!r} column (columns: {sorted(row)}).")
        problem_id = str(row.get("unique_id", row.get("id", index)))
        problems.append(Problem(id=problem_id, question=str(row[spec.question_column]), gold=spec.gold(row)))
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Prompts and generation
# ---------------------------------------------------------------------------------------------------------------


def build_prompt(
    tokenizer,
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> str:
    """The zero-shot prompt: one user turn (question + instruction), chat-templated, ready for the answer."""
    user_turn = f"{question}\n{instruction}" if instruction else question
    if not use_chat_template:
        return f"Question: {user_turn}\nAnswer:"
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "The tokenizer has no chat template. Use a chat/instruct model's tokenizer, set "
            "`tokenizer.chat_template`, or pass `use_chat_template=False` (--no-chat-template) for a plain prompt."
        )
    messages = [{"role": "user", "content": user_turn}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _eos_token_ids(model, tokenizer) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("Neither the model's generation config nor the tokenizer defines an EOS token.")
    return ids


def generation_kwargs(sampling: SamplingConfig, eos_token_ids: list[int], pad_token_id: int) -> dict:
    """`GenerationConfig` fields for `sampling`: temperature and top-p only (top-k off), or greedy decoding."""
    kwargs = {
        "do_sample": sampling.do_sample,
        "num_return_sequences": sampling.num_samples,
        "max_new_tokens": sampling.max_new_tokens,
        "eos_token_id": eos_token_ids,
        "pad_token_id": pad_token_id,
    }
    if sampling.do_sample:
        # top_k=0 switches top-k off: left unset, transformers would fill in its default of 50.
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    return kwargs


class DecodingProgress:
    """A stopping criterion that never stops: `generate` calls it once per decoding step, and it moves the bar.

    The bar counts decoding steps (new tokens per row) over every batch, so a long batch shows its progress and an
    ETA instead of sitting at 0/1; a batch that ends early (every row at EOS) skips its remaining steps."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    sampling: SamplingConfig,
    batch_size: int = 8,
    description: str = "generating",
) -> list[list[str]]:
    """`sampling.num_samples` completions per prompt, `batch_size` prompts per `generate` call (left padded).

    The random state is reset to `seed + batch index` before every batch: the same seed and batch size give the
    same samples.
    """

    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    eos_ids = _eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    generation_config = GenerationConfig(**generation_kwargs(sampling, eos_ids, pad_id))
    device = next(model.parameters()).device
    saved_padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation needs the prompts right-aligned
    completions: list[list[str]] = []
    batches = range(0, len(prompts), batch_size)
    bar = tqdm(total=len(batches) * sampling.max_new_tokens, desc=description, unit="token")
    bar.set_postfix_str(f"0/{len(prompts)} problems")
    try:
        for batch_index, start in enumerate(batches):
            batch_prompts = list(prompts[start : start + batch_size])
            # Chat templates already contain the BOS/special tokens they need.
            encoded = tokenizer(batch_prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            encoded = {key: value.to(device) for key, value in encoded.items()}
            set_seed(sampling.seed + batch_index)
            output = model.generate(
                **encoded, generation_config=generation_config, stopping_criteria=[DecodingProgress(bar)]
            )
            bar.update((batch_index + 1) * sampling.max_new_tokens - bar.n)  # the steps an early end skipped
            new_tokens = output[:, encoded["input_ids"].shape[1] :]
            texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            for prompt_index in range(len(batch_prompts)):
                first = prompt_index * sampling.num_samples
                completions.append(texts[first : first + sampling.num_samples])
            bar.set_postfix_str(f"{len(completions)}/{len(prompts)} problems")
    finally:
        bar.close()
        tokenizer.padding_side = saved_padding_side
    return completions


# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------


def score_completions(problems: Sequence[Problem], completions: Sequence[Sequence[str]]) -> dict:
    """Per-problem records and the aggregate metrics (`pass@1`, `maj@k`, `no_answer_rate`), all in [0, 1]."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completion lists.")
    if not problems:
        raise ValueError("Nothing to score: no problems.")
    num_samples = {len(samples) for samples in completions}
    if len(num_samples) != 1 or 0 in num_samples:
        raise ValueError(f"Every problem needs the same, non-zero number of samples; got {sorted(num_samples)}.")
    k = num_samples.pop()
    records = []
    pass_at_1 = majority_correct = no_answer = 0.0
    for problem, samples in zip(problems, completions):
        gold = parse_answer(problem.gold)
        if gold is None:
            raise ValueError(f"math-verify cannot parse the reference answer of problem {problem.id}: {problem.gold!r}")
        answers, parsed = zip(*(read_answer(text) for text in samples))
        correct = [parsed_equivalent(gold, prediction) for prediction in parsed]
        vote = majority_vote(answers, parsed=parsed)
        vote_correct = vote.sample_index is not None and correct[vote.sample_index]
        pass_at_1 += sum(correct) / k
        majority_correct += float(vote_correct)
        no_answer += sum(prediction is None for prediction in parsed) / k
        records.append(
            {
                "id": problem.id,
                "question": problem.question,
                "gold": problem.gold,
                "samples": [
                    {"completion": text, "answer": answer, "correct": is_correct}
                    for text, answer, is_correct in zip(samples, answers, correct)
                ],
                "majority": {"answer": vote.answer, "votes": vote.votes, "correct": vote_correct},
            }
        )
    n = len(problems)
    metrics = {"pass@1": pass_at_1 / n, f"maj@{k}": majority_correct / n, "no_answer_rate": no_answer / n}
    return {"metrics": metrics, "num_problems": n, "num_samples": k, "problems": records}


@dataclass
class MathEvalResult:
    model: str
    benchmark: str
    source: str
    sampling: dict
    metrics: dict
    num_problems: int
    num_samples: int
    problems: list = field(repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_math(
    model,
    tokenizer,
    problems: Sequence[Problem],
    sampling: SamplingConfig | None = None,
    batch_size: int = 8,
    model_name: str = "model",
    benchmark: str = "math",
    source: str = "",
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> MathEvalResult:
    """Generate, extract, check and aggregate: the whole evaluation of one model on one benchmark."""
    sampling = sampling or PRESETS["greedy"]
    prompts = [build_prompt(tokenizer, p.question, instruction, system_prompt, use_chat_template) for p in problems]
    completions = generate_completions(
        model, tokenizer, prompts, sampling, batch_size=batch_size, description=f"{model_name} / {benchmark}"
    )
    scored = score_completions(problems, completions)
    return MathEvalResult(
        model=model_name,
        benchmark=benchmark,
        source=source,
        sampling=asdict(sampling),
        metrics=scored["metrics"],
        num_problems=scored["num_problems"],
        num_samples=scored["num_samples"],
        problems=scored["problems"],
    )


# ---------------------------------------------------------------------------------------------------------------
# Loading models and writing files
# ---------------------------------------------------------------------------------------------------------------


def load_model_and_tokenizer(
    path: str,
    dtype: str = "auto",
    device: str | None = None,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
):
    """An `AutoModelForCausalLM` (IHA folders included: `import iha` registers the classes) and its tokenizer."""

    if dtype != "auto" and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"`dtype` must be 'auto' or the name of a torch dtype (e.g. 'bfloat16'), got {dtype!r}.")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file:
        extra["quantization_config"] = GgufConfig(dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **extra)
    model.to(device).eval()
    return model, tokenizer


__all__ = [
    "BENCHMARKS",
    "BenchmarkSpec",
    "DEFAULT_INSTRUCTION",
    "MathEvalResult",
    "PRESETS",
    "Problem",
    "SamplingConfig",
    "build_prompt",
    "evaluate_math",
    "generate_completions",
    "generation_kwargs",
    "load_model_and_tokenizer",
    "load_problems",
    "sampling_preset",
    "score_completions",
]
