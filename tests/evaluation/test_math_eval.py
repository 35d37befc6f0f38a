"""Math evaluation: data loading, prompts, scoring, and a tiny end-to-end run of a converted model on GSM8K rows."""

import json

import pytest
from testing_utils import tiny_llama_for_tokenizer
from transformers import AutoTokenizer

from iha.cli.eval import main as eval_main
from iha.conversion import llama_to_iha
from iha.conversion.builtin import smollm2_dir
from iha.evaluation import PRESETS, SamplingConfig, sampling_preset
from iha.evaluation.math_eval import Problem, build_prompt, evaluate_math, load_problems, score_completions


# --- data -----------------------------------------------------------------------------------------------------------


def test_load_local_gsm8k_and_math500(test_data):
    gsm8k = load_problems(str(test_data / "gsm8k" / "test.jsonl"), limit=3)
    assert len(gsm8k) == 3
    assert gsm8k[0].gold == "18" and gsm8k[0].question.startswith("Janet")
    math500 = load_problems(str(test_data / "math500" / "test.jsonl"), limit=2)
    first_row = json.loads((test_data / "math500" / "test.jsonl").read_text().splitlines()[0])
    assert math500[0].gold == first_row["answer"] and math500[0].question == first_row["problem"]
    assert math500[0].id == first_row["unique_id"]


def test_load_rejects_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^Data file .*missing\.jsonl does not exist"):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="is a folder: give the .json / .jsonl file"):
        load_problems(str(tmp_path))
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="Cannot tell the format"):
        load_problems(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "1+1?", "answer": "#### 2"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl, line 2: not valid JSON"):
        load_problems(str(broken))
    with pytest.raises(ValueError, match="Unknown benchmark"):
        load_problems(str(broken), benchmark="mmlu")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("gsm8k", ("openai/gsm8k", "main", "test")),
        ("openai/gsm8k", ("openai/gsm8k", "main", "test")),  # the Hub id alone needs the config name too
        ("HuggingFaceH4/MATH-500", ("HuggingFaceH4/MATH-500", None, "test")),
    ],
)
def test_hub_sources_load_with_their_config(monkeypatch, test_data, source, expected):
    import datasets

    rows = [json.loads(line) for line in (test_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:2]]
    if "MATH" in source:
        rows = [json.loads(line) for line in (test_data / "math500" / "test.jsonl").read_text().splitlines()[:2]]
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append((*args, kwargs)) or rows)
    problems = load_problems(source)
    assert calls == [(expected[0], expected[1], {"split": expected[2]})]
    assert [problem.question for problem in problems] == [row.get("question", row.get("problem")) for row in rows]


def test_sampling_presets_and_validation():
    paper = PRESETS["paper"]
    assert (paper.temperature, paper.num_samples) == (0.6, 16)
    assert sampling_preset("paper", num_samples=4, seed=None).num_samples == 4
    with pytest.raises(ValueError, match="identical samples"):
        SamplingConfig(temperature=0.0, num_samples=4)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=0.6, top_p=0.0)


def test_generation_settings_follow_the_sampling_config():
    from iha.evaluation.math_eval import generation_kwargs

    sampled = generation_kwargs(sampling_preset("paper"), [2], 2)
    assert sampled["do_sample"] and (sampled["temperature"], sampled["top_p"]) == (0.6, 0.95)
    assert sampled["top_k"] == 0  # no hidden top-k: transformers would otherwise default to 50
    assert sampled["num_return_sequences"] == 16 and sampled["max_new_tokens"] == 4096
    greedy = generation_kwargs(sampling_preset("greedy"), [2], 2)
    assert not greedy["do_sample"] and "temperature" not in greedy and greedy["num_return_sequences"] == 1


# --- scoring --------------------------------------------------------------------------------------------------------


def test_score_completions_pass_at_1_and_majority():
    problems = [Problem("a", "q1", "\\frac{1}{2}"), Problem("b", "q2", "18"), Problem("c", "q3", "7")]
    completions = [
        # 2 of 4 correct (0.5 and 1/2 both count); majority class {0.5, 1/2} wins 2 - 1 - 0 (no answer does not vote).
        ["\\boxed{0.5}", "\\boxed{3}", "so 1/2 #### 1/2", "I don't know"],
        # 1 of 4 correct; 19, 18 and 20 have one vote each: the earliest class (19) wins -> majority wrong.
        ["\\boxed{19}", "\\boxed{18}", "\\boxed{20}", "no answer"],
        # Tie between 5 (first) and 7: the earlier class wins, so the majority is wrong although half are right.
        ["\\boxed{5}", "\\boxed{7}", "\\boxed{7.0}", "\\boxed{5}"],
    ]
    scored = score_completions(problems, completions)
    metrics = scored["metrics"]
    assert metrics["pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 2 / 4) / 3)
    assert metrics["maj@4"] == pytest.approx(1 / 3)
    assert metrics["no_answer_rate"] == pytest.approx((1 / 4 + 1 / 4 + 0) / 3)
    first = scored["problems"][0]
    assert [sample["correct"] for sample in first["samples"]] == [True, False, True, False]
    # The class is reported by its first member, as math-verify read it from the box (0.5 normalised to a fraction).
    assert first["majority"] == {"answer": "\\frac{1}{2}", "votes": 2, "correct": True}
    assert [sample["answer"] for sample in first["samples"]] == ["\\frac{1}{2}", "3", "1/2", None]
    assert scored["problems"][2]["majority"]["answer"] == "5"


def test_score_completions_rejects_ragged_samples():
    with pytest.raises(ValueError, match="same, non-zero number"):
        score_completions([Problem("a", "q", "1"), Problem("b", "q", "2")], [["\\boxed{1}"], []])


# --- a converted model, end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def llama_and_iha(tokenizer):
    """A tiny random Llama with the SmolLM2 tokenizer, and its exact IHA conversion (P = 2)."""
    llama = tiny_llama_for_tokenizer(tokenizer)
    converted = llama_to_iha(llama, num_pseudo_heads=2).eval()  # exact by default
    return llama, converted


def test_prompt_is_chat_templated_with_the_boxed_instruction(tokenizer):
    prompt = build_prompt(tokenizer, "What is 2 + 3?")
    assert "<|im_start|>user\nWhat is 2 + 3?\nPlease reason step by step" in prompt
    assert "\\boxed{}" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert build_prompt(tokenizer, "Q", use_chat_template=False) == (
        "Question: Q\nPlease reason step by step, and put your final answer within \\boxed{}.\nAnswer:"
    )


def test_tokenizer_without_chat_template_is_a_clear_error(tokenizer):
    bare = AutoTokenizer.from_pretrained(smollm2_dir())
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        build_prompt(bare, "What is 2 + 3?")


def test_converted_model_evaluates_like_its_source(test_data, tokenizer, llama_and_iha):
    llama, converted = llama_and_iha
    problems = load_problems(str(test_data / "gsm8k" / "test.jsonl"), limit=3)
    sampling = SamplingConfig(temperature=0.0, num_samples=1, max_new_tokens=8)
    base = evaluate_math(llama, tokenizer, problems, sampling, batch_size=2, model_name="llama", benchmark="gsm8k")
    ours = evaluate_math(converted, tokenizer, problems, sampling, batch_size=2, model_name="iha", benchmark="gsm8k")
    base_texts = [p["samples"][0]["completion"] for p in base.problems]
    assert base_texts == [p["samples"][0]["completion"] for p in ours.problems]
    assert all(text for text in base_texts)  # something was generated, and it is the continuation only
    assert not any("Janet" in text for text in base_texts)
    assert base.metrics == ours.metrics
    assert base.num_problems == 3 and base.num_samples == 1
    assert tokenizer.padding_side == AutoTokenizer.from_pretrained(smollm2_dir()).padding_side  # restored


def test_progress_counts_decoding_steps_and_problems_not_batches(
    test_data, tokenizer, llama_and_iha, capsys, monkeypatch
):
    import iha.evaluation.math_eval as math_eval

    _, converted = llama_and_iha
    problems = load_problems(str(test_data / "gsm8k" / "test.jsonl"), limit=3)
    prompts = [build_prompt(tokenizer, problem.question) for problem in problems]
    sampling = SamplingConfig(temperature=0.0, num_samples=1, max_new_tokens=5)
    steps = []

    class CountingBar:  # stands in for tqdm, to see every update the bar gets
        def __init__(self, total, **kwargs):
            self.total, self.n, self.postfix = total, 0, ""

        def update(self, count):
            self.n += count
            steps.append(self.n)

        def set_postfix_str(self, text):
            self.postfix = text

        def close(self):
            pass

    with monkeypatch.context() as patched:
        patched.setattr(math_eval, "tqdm", CountingBar)
        completions = math_eval.generate_completions(converted, tokenizer, prompts, sampling, batch_size=2)
    assert len(completions) == 3
    # Two batches of 5 decoding steps: the bar moves within a batch (an ETA from the first step on), ends at 10.
    assert steps[0] == 1 and steps[-1] == 10 and len(steps) > 2, steps
    math_eval.generate_completions(converted, tokenizer, prompts, sampling, batch_size=2)
    assert "3/3 problems" in capsys.readouterr().err  # the real bar names problems, not batches


def test_sampling_is_seeded(test_data, tokenizer, llama_and_iha):
    _, converted = llama_and_iha
    problems = load_problems(str(test_data / "gsm8k" / "test.jsonl"), limit=2)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, num_samples=3, max_new_tokens=6, seed=11)
    first = evaluate_math(converted, tokenizer, problems, sampling, batch_size=2)
    second = evaluate_math(converted, tokenizer, problems, sampling, batch_size=2)
    texts = [[s["completion"] for s in p["samples"]] for p in first.problems]
    assert texts == [[s["completion"] for s in p["samples"]] for p in second.problems]
    assert all(len(set(samples)) > 1 for samples in texts)  # a random model sampling at T=1 varies
    assert first.num_samples == 3 and "maj@3" in first.metrics


def test_cli_writes_a_side_by_side_report(test_data, tokenizer, llama_and_iha, tmp_path):
    llama, converted = llama_and_iha
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    converted.save_pretrained(tmp_path / "iha")
    tokenizer.save_pretrained(tmp_path / "iha")
    output = tmp_path / "eval"
    common = ["--dtype", "float32", "--device", "cpu", "--batch-size", "2"]
    eval_main(
        ["math", "--model", f"base={tmp_path / 'llama'}", "--model", f"iha={tmp_path / 'iha'}", *common]
        + ["--dataset", f"gsm8k={test_data / 'gsm8k' / 'test.jsonl'}", "--limit", "2", "--max-new-tokens", "4"]
        + ["--output-dir", str(output)]
    )
    base = json.loads((output / "base_gsm8k.json").read_text())
    ours = json.loads((output / "iha_gsm8k.json").read_text())
    assert len(base["problems"]) == len(ours["problems"]) == 2
    assert base["metrics"] == ours["metrics"]
    report = (output / "report.md").read_text()
    assert "| Benchmark | Metric | base | iha | iha − base |" in report
    assert "| GSM8K | pass@1 |" in report and "+0.0 |" in report
    summary = json.loads((output / "report.json").read_text())
    assert [item["model"] for item in summary] == ["base", "iha"] and "problems" not in summary[0]
    # `compare` rebuilds the same table from the per-model files.
    eval_main(
        ["compare", str(output / "base_gsm8k.json"), str(output / "iha_gsm8k.json"), "--output", str(tmp_path / "c.md")]
    )
    assert (tmp_path / "c.md").read_text().split("\n\n")[-1] == report.split("\n\n")[-1]
