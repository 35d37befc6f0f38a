"""The multi-key needle generator: deterministic, sized to the context, and scored by exact match."""

import json
import re

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from iha.conversion.builtin import smollm2_dir
from iha.evaluation.needle import (
    NeedleConfig,
    evaluate_needle,
    evaluate_needle_examples,
    make_needle_examples,
    score_needle_answer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


def value_in_prompt(prompt: str, key: str) -> str:
    return re.search(rf"The special magic number for {re.escape(key)} is: (\d+)\.", prompt).group(1)


def copying_model(examples):
    """A 'model' that reads the needle of every queried key off the prompt and copies its value."""
    return [", ".join(value_in_prompt(example.prompt, key) for key in example.query_keys) + "." for example in examples]


def distractor_model(examples):
    """Answers with the value of a needle that was *not* asked about."""
    answers = []
    for example in examples:
        other = [key for key in example.needles if key not in example.query_keys][0]
        answers.append(value_in_prompt(example.prompt, other))
    return answers


def test_deterministic_per_seed(tokenizer):
    config = NeedleConfig(context_length=300, num_keys=2, num_distractors=3, num_examples=4, seed=7)
    first = make_needle_examples(config, tokenizer)
    second = make_needle_examples(config, tokenizer)
    assert [e.prompt for e in first] == [e.prompt for e in second]
    assert [e.expected_values for e in first] == [e.expected_values for e in second]
    other_seed = make_needle_examples(NeedleConfig(300, 2, 3, 4, seed=8), tokenizer)
    assert [e.prompt for e in other_seed] != [e.prompt for e in first]
    # Example i does not depend on how many examples are drawn.
    assert make_needle_examples(NeedleConfig(300, 2, 3, 2, seed=7), tokenizer)[1].prompt == first[1].prompt


def test_examples_hold_every_needle_and_fit_the_context(tokenizer):
    config = NeedleConfig(context_length=512, num_keys=2, num_distractors=4, num_examples=6, seed=0)
    for example in make_needle_examples(config, tokenizer):
        assert len(example.needles) == 6 and len(set(example.needles.values())) == 6
        for key, value in example.needles.items():
            assert value_in_prompt(example.prompt, key) == value
            assert example.prompt.count(f"for {key} is") == 1
        assert example.expected_values == [example.needles[key] for key in example.query_keys]
        assert all(key in example.prompt.rsplit("\n", 1)[-1] for key in example.query_keys)  # asked in the question
        assert example.num_tokens == len(tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
        # As long as possible without going over: one more filler sentence would not fit.
        assert 512 - 30 <= example.num_tokens <= 512
        assert all(0.0 <= depth <= 1.0 for depth in example.depths)


def test_depths_spread_over_the_haystack(tokenizer):
    config = NeedleConfig(context_length=400, num_keys=1, num_distractors=1, num_examples=20, seed=3)
    depths = [depth for example in make_needle_examples(config, tokenizer) for depth in example.depths]
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_copying_model_scores_100_and_distractor_model_scores_0(tokenizer):
    config = NeedleConfig(context_length=400, num_keys=2, num_distractors=3, num_examples=5, seed=1)
    examples = make_needle_examples(config, tokenizer)
    perfect = evaluate_needle_examples(examples, copying_model, batch_size=2)
    assert perfect["score"] == 1.0 and perfect["all_found"] == 1.0
    wrong = evaluate_needle_examples(examples, distractor_model, batch_size=2)
    assert wrong["score"] == 0.0 and wrong["all_found"] == 0.0


def test_exact_match_scoring():
    assert score_needle_answer("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert score_needle_answer("1234567", ["1234567", "7654321"]) == 0.5
    assert score_needle_answer("12345678", ["1234567"]) == 0.0  # a longer number is not the value
    assert score_needle_answer("123456", ["1234567"]) == 0.0  # neither is a prefix


def test_context_too_short_is_a_clear_error():
    with pytest.raises(ValueError, match="too short"):
        make_needle_examples(NeedleConfig(context_length=20, num_keys=1, num_distractors=5, num_examples=1))


def test_runs_on_a_causal_lm(tokenizer):
    # A tiny random Llama cannot know the numbers: the harness must report 0, not crash or leak the answers.
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    result = evaluate_needle(
        model, tokenizer, [200, 300], num_keys=1, num_distractors=2, num_examples=2, max_new_tokens=4, batch_size=2
    )
    assert [row["context_length"] for row in result["by_length"]] == [200, 300]
    for row in result["by_length"]:
        assert len(row["examples"]) == 2
        assert row["score"] == 0.0
        assert all(not re.search(r"\d{7}", example["answer"]) for example in row["examples"])


def test_needle_cli_writes_results_and_report(tokenizer, tmp_path, monkeypatch, capsys):
    from iha.cli.eval import main as eval_main

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    # No --output-dir: the default, runs/needle, under the working directory.
    monkeypatch.chdir(tmp_path)
    eval_main(
        ["needle", "--model", f"tiny={tmp_path / 'tiny'}", "--lengths", "150", "250", "--num-examples", "2"]
        + ["--num-keys", "2", "--num-distractors", "1", "--max-new-tokens", "3", "--device", "cpu"]
    )
    captured = capsys.readouterr()
    assert "needle: 2 examples at each of 2 context lengths (150, 250 tokens)" in captured.out
    assert "tiny / needle 250 tokens" in captured.err  # a progress bar per context length
    (tmp_path / "runs" / "needle").rename(tmp_path / "out")
    result = json.loads((tmp_path / "out" / "needle_tiny.json").read_text())
    assert result["config"]["num_keys"] == 2 and result["config"]["num_distractors"] == 1
    assert [row["context_length"] for row in result["by_length"]] == [150, 250]
    assert all(len(row["examples"][0]["expected"]) == 2 for row in result["by_length"])
    report = (tmp_path / "out" / "needle_report.md").read_text()
    assert "| Context (tokens) | tiny score | tiny all-found |" in report
    assert "| 150 | 0.0 | 0.0 |" in report and "| 250 | 0.0 | 0.0 |" in report


@pytest.mark.parametrize(
    "command, expected",
    [
        (
            "needle",
            ["(default: 50)", "(default: [1024, 2048, 4096])", "(default: 8)", "(default: 32)", "(default: 0)"]
            + ["(default: runs/needle)", "about 45 minutes"],
        ),
        ("math", ["(default: greedy)", "greedy 1024, paper 4096", "(default: runs/eval)", "openai/gsm8k"]),
    ],
)
def test_eval_help_shows_the_defaults(command, expected, capsys):
    from iha.cli.eval import main as eval_main

    with pytest.raises(SystemExit) as exit_info:
        eval_main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for phrase in expected:
        assert phrase in text, phrase
