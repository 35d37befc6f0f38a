"""The commands other than `iha-convert` under faults: Ctrl-C or SIGTERM mid-work gives one line and exit 128 + the
signal, leaves no staging folder and no half-written output; bad input gives one line."""

import json
import signal

import pytest
from testing_utils import finish

from iha.cli.main import main as iha_main
from iha.data.word_problems import arithmetic_word_problems
from iha.demo.pipeline import build_training_rows


def listing(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def assert_one_line_interruption(process, prog: str, signum: int, out: str, err: str) -> str:
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: interrupted ({signal.Signals(signum).name})"), err
    return last


@pytest.fixture(scope="module")
def problems_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_word_problems(8, seed=5)))
    return path


DEMO_ARGS = ["--num-train", "8", "--num-eval", "2", "--max-steps", "1", "--max-new-tokens", "2", "--max-length", "256"]


# Both signals reach the same handler (`iha.cli.running.run_command`: SIGTERM is raised as KeyboardInterrupt), so
# each signal is sent once, one to a demo writing a new folder, the other to one replacing an old folder.
@pytest.mark.slow
@pytest.mark.parametrize("signum, overwrite", [(signal.SIGINT, False), (signal.SIGTERM, True)])
def test_interrupted_demo_leaves_nothing_and_keeps_an_old_folder(
    paused_command, tiny_llama_dir, tmp_path, signum, overwrite
):
    work = tmp_path / "work"
    (work / "old").mkdir(parents=True)
    (work / "old" / "notes.txt").write_text("mine")
    output, extra = (work / "old", ["--overwrite"]) if overwrite else (work / "new" / "demo", [])
    ready = tmp_path / "ready"
    argv = ["demo", "--model", str(tiny_llama_dir), "--output-dir", str(output), *DEMO_ARGS, *extra]
    # Stopped before the first evaluation: the converted model is already written (in the staging folder).
    process = paused_command(ready, "iha.demo.pipeline:evaluate", 1, argv)
    assert any(".iha-demo-" in name for name in listing(output.parent))
    process.send_signal(signum)
    out, err = finish(process)
    last = assert_one_line_interruption(process, "iha demo", signum, out, err)
    assert last.endswith(f"nothing was written to {output}")
    assert listing(work) == ["old"] and listing(work / "old") == ["notes.txt"]


def test_demo_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys):
    assert iha_main(["demo", "--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "new" / "d")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"iha demo: error: The folder {tmp_path / 'missing'} does not exist."]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert iha_main(["demo", "--output-dir", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert "holds files that no earlier demo wrote: pass --overwrite" in err and "Errno" not in err
    assert listing(tmp_path) == ["taken"]


def one_step_sft_argv(model_dir, tmp_path, output) -> list[str]:
    """`iha sft` for one CPU step of the tiny model on 8 rows written to tmp_path, saving to `output`."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in build_training_rows(None, 8, seed=0)))
    argv = ["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data)]
    return argv + ["--output_dir", str(output), "--max_steps", "1", "--use_cpu", "true", "--report_to", "none"]


@pytest.mark.slow
def test_interrupted_sft_is_one_line(paused_command, tiny_llama_dir, tmp_path):
    output = tmp_path / "run"
    argv = one_step_sft_argv(tiny_llama_dir, tmp_path, output)
    process = paused_command(tmp_path / "ready", "iha.training:IHASFTTrainer.train", 1, argv)
    process.send_signal(signal.SIGINT)
    out, err = finish(process)
    assert_one_line_interruption(process, "iha sft", signal.SIGINT, out, err)
    assert not (output / "model.safetensors").exists()


@pytest.mark.slow
def test_sft_killed_while_saving_leaves_no_partial_model(paused_command, tiny_llama_dir, tmp_path):
    # Stopped after the model's weights are written and before its tokenizer is: a direct save would leave a
    # model folder without a tokenizer; the staged save leaves no model file in the output at all.
    output = tmp_path / "run"
    argv = one_step_sft_argv(tiny_llama_dir, tmp_path, output)
    target = "transformers.tokenization_utils_base:PreTrainedTokenizerBase.save_pretrained"
    process = paused_command(tmp_path / "ready", target, 2, argv)  # the first call saves checkpoint-1
    staged = [path for path in tmp_path.glob(".run.iha-sft-*/model.safetensors")]
    assert len(staged) == 1, "the weights are written to the staging folder first"
    process.kill()
    finish(process)
    assert not (output / "model.safetensors").exists() and not (output / "config.json").exists()


def test_sft_bad_dataset_is_one_line(tiny_llama_dir, tmp_path, capsys):
    argv = ["sft", "--model_name_or_path", str(tiny_llama_dir), "--dataset_name", str(tmp_path / "missing.jsonl")]
    assert iha_main([*argv, "--output_dir", str(tmp_path / "new" / "run"), "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"iha sft: error: Data file {tmp_path / 'missing.jsonl'} does not")
    assert "Traceback" not in err and listing(tmp_path) == []


@pytest.mark.slow
def test_interrupted_eval_writes_no_result(paused_command, tiny_llama_dir, problems_file, tmp_path):
    output = tmp_path / "new" / "eval"
    argv = ["eval", "math", "--model", f"tiny={tiny_llama_dir}", "--dataset", f"gsm8k={problems_file}"]
    argv += ["--output-dir", str(output), "--limit", "2", "--max-new-tokens", "2", "--device", "cpu"]
    process = paused_command(tmp_path / "ready", "iha.evaluation.math_eval:evaluate_math", 1, argv)
    process.send_signal(signal.SIGTERM)
    out, err = finish(process)
    assert_one_line_interruption(process, "iha eval math", signal.SIGTERM, out, err)
    assert listing(tmp_path) == ["ready"]


def test_eval_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    argv = ["eval", "math", "--model", "x/y", "--dataset", f"gsm8k={tmp_path / 'bad.json'}", "--output-dir", "o"]
    assert iha_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iha eval math: error: {tmp_path / 'bad.json'} is not valid JSON") and err.count("\n") == 1


# Every command that takes a model, given a folder that does not exist: (argv with MISSING for the folder).
MISSING_FOLDER_COMMANDS = [
    ["convert", "MISSING", "OUT"],
    ["demo", "--model", "MISSING", "--output-dir", "OUT"],
    ["sft", "--model_name_or_path", "MISSING", "--dataset_name", "rows.jsonl", "--output_dir", "OUT"],
    ["sft", "--model_name_or_path", "org/name", "--tokenizer_name_or_path", "MISSING", "--dataset_name", "d"],
    ["eval", "math", "--model", "MISSING", "--dataset", "gsm8k", "--output-dir", "OUT"],
    ["eval", "needle", "--model", "base=org/name", "--model", "MISSING", "--output-dir", "OUT"],
    ["serve", "MISSING"],
    ["chat-template", "OUT", "--tokenizer", "MISSING"],
    ["card", "MISSING", "--base-model", "org/name"],
    ["card", "FOLDER", "--base-model", "MISSING"],
    ["push", "MISSING", "org/name"],
    ["convert", "push", "MISSING", "org/name"],
]


@pytest.mark.parametrize("argv", MISSING_FOLDER_COMMANDS, ids=lambda argv: " ".join(argv[:3]))
def test_a_missing_model_folder_is_one_line_saying_so_and_exit_2(argv, tmp_path, capsys, monkeypatch):
    # Relative paths, as a user types them: huggingface_hub would read `./missing` as a malformed repository id.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FOLDER").mkdir()
    (tmp_path / "FOLDER" / "config.json").write_text("{}")
    words = ["./missing" if word == "MISSING" else word for word in argv]
    assert iha_main(words) == 2
    captured = capsys.readouterr()
    prog = "iha " + " ".join(argv[:2] if argv[0] == "eval" else argv[:1])
    if argv[:2] == ["convert", "push"]:
        prog = "iha convert push"
    assert captured.err.strip().splitlines() == [f"{prog}: error: The folder ./missing does not exist."]
    assert "Traceback" not in captured.err and sorted(path.name for path in tmp_path.iterdir()) == ["FOLDER"]
