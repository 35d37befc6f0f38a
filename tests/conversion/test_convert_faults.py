"""`iha-convert` under faults: killed runs, signals, bad input, failures after writing started, quiet mode, and
settings whose change only shows on long inputs."""

import json
import os
import signal
from pathlib import Path

import pytest
from testing_utils import finish, folder_listing, make_source

from iha import conversion as convert
from iha.cli import convert as convert_command
from iha.cli.main import run
from iha.conversion.builtin import smollm2_dir
from iha.conversion.report import REPORT_NAME, function_change_warning


# Where the kill tests stop a conversion: before the third tensor copied into the weights file (mid-write), and
# before the converted model's forward pass (mid-verification: the source ran on the fixed batch twice already).
PAUSE_POINTS = {
    "writing": ("iha.conversion.readers:SafetensorsReader.copy_raw", 3),
    "verifying": ("iha.conversion.verify:logits_of_real_tokens", 3),
}


def start_paused_conversion(paused_command, tmp_path: Path, point: str, args: list[str]):
    target, nth = PAUSE_POINTS[point]
    return paused_command(tmp_path / f"ready-{point}", target, nth, ["convert", *args])


def staging_folders(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if ".iha-convert-" in path.name)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return make_source("llama3", tmp_path_factory.mktemp("source") / "source")


# Both signals reach one handler (`iha.cli.running.run_command` raises SIGTERM as KeyboardInterrupt): each point is
# interrupted once, each signal sent once.
@pytest.mark.parametrize("point, signum", [("writing", signal.SIGINT), ("verifying", signal.SIGTERM)])
def test_signalled_conversion_leaves_nothing_and_says_so_in_one_line(
    paused_command, tiny_source, tmp_path, point, signum
):
    work = tmp_path / "work"
    work.mkdir()
    output = work / "new" / "deeper" / "out"  # parents that do not exist yet: the run creates them
    process = start_paused_conversion(paused_command, tmp_path, point, [str(tiny_source), str(output), "--quiet"])
    assert staging_folders(output.parent), "the run should be writing its staging folder now"
    process.send_signal(signum)
    out, err = finish(process)
    name = signal.Signals(signum).name
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    # Run as `iha convert` (the paused command is the `iha` dispatcher): it names itself so.
    assert err.strip().splitlines()[-1] == f"iha convert: interrupted ({name}); nothing was written to {output}"
    assert folder_listing(work) == []  # no staging folder, no output, no created parents
    assert f"ready-{point}" in folder_listing(tmp_path)  # it did stop where the test says


def test_killed_conversion_is_cleaned_up_by_the_next_run(paused_command, tiny_source, tmp_path, capsys):
    output = tmp_path / "out"
    process = start_paused_conversion(paused_command, tmp_path, "verifying", [str(tiny_source), str(output), "-q"])
    process.kill()  # SIGKILL: nothing can clean up
    finish(process)
    left = staging_folders(tmp_path)
    assert len(left) == 1 and (tmp_path / left[0] / "model.safetensors").is_file()

    assert convert_command.main([str(tiny_source), str(output), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"Removed 1 staging folder(s) that a killed earlier run of iha-convert left next to {output}" in err
    assert left[0] in err
    assert staging_folders(tmp_path) == [] and (output / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_running_conversions_staging_folder_is_left_alone(paused_command, tiny_source, tmp_path, capsys):
    output = tmp_path / "out"
    running = start_paused_conversion(paused_command, tmp_path, "writing", [str(tiny_source), str(output), "-q"])
    try:
        theirs = staging_folders(tmp_path)
        assert convert_command.main([str(tiny_source), str(tmp_path / "out"), "--quiet"]) == 0
        assert "is still writing" in capsys.readouterr().err
        assert staging_folders(tmp_path) == theirs  # still there: its run holds the lock
    finally:
        running.send_signal(signal.SIGTERM)
        _, err = finish(running)
    assert running.returncode == 128 + signal.SIGTERM, err
    assert staging_folders(tmp_path) == [] and (output / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing left behind
# ---------------------------------------------------------------------------------------------------------------


def copy_of(source: Path, folder: Path) -> Path:
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def write_safetensors_header(path: Path, header: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json holds a JSON list, not an object"),
        (
            lambda f: write_safetensors_header(f / "model.safetensors", b"[1, 2]"),
            "is not a valid safetensors file (the header is a JSON list, not an object)",
        ),
        (
            lambda f: write_safetensors_header(f / "model.safetensors", b'{"a": {"dtype": "F32"}}'),
            "the header entry of tensor a is {'dtype': 'F32'}",
        ),
        (
            lambda f: write_safetensors_header(f / "model.safetensors", b'{"a": 5}'),
            "the header entry of tensor a is 5",
        ),
        (
            lambda f: os.truncate(f / "model.safetensors", (f / "model.safetensors").stat().st_size - 100),
            "is truncated: tensor",
        ),
        (
            lambda f: (f / "model.safetensors.index.json").write_text("[1]"),
            "model.safetensors.index.json is not a valid weight index",
        ),
    ],
    ids=[
        "config-not-json",
        "config-a-list",
        "header-a-list",
        "entry-incomplete",
        "entry-a-number",
        "truncated",
        "index",
    ],
)
def test_damaged_source_gets_one_line(tiny_source, tmp_path, capsys, damage, message):
    source = copy_of(tiny_source, tmp_path / "source")
    damage(source)
    listing = folder_listing(tmp_path)
    assert convert_command.main([str(source), str(tmp_path / "new" / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("iha-convert: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert folder_listing(tmp_path) == listing


def test_unwritable_destination_gets_one_line(tiny_source, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert convert_command.main([str(tiny_source), str(tmp_path / "a-file" / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"iha-convert: error: {tmp_path / 'a-file'} is a file, not a folder; choose another output\n"
    assert len(err.strip().splitlines()) == 1

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.access(read_only, os.W_OK):  # root ignores the mode: use a folder the kernel itself refuses
        read_only = Path("/sys/kernel")
        if not read_only.is_dir() or os.access(read_only, os.W_OK) and os.geteuid() != 0:
            pytest.skip("no read-only folder to write into")
    assert convert_command.main([str(tiny_source), str(read_only / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iha-convert: error: cannot write in {read_only}") and "Errno" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_bad_tolerance_gets_one_line(tiny_source, tmp_path, capsys):
    assert convert_command.main([str(tiny_source), str(tmp_path / "out"), "--tolerance", "-1"]) == 2
    assert "--tolerance must be a positive number" in capsys.readouterr().err
    assert folder_listing(tmp_path) == []


def test_push_of_a_folder_with_a_damaged_config_gets_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert run("convert", ["push", str(tmp_path), "someone/x"]) == 2  # `iha-convert push`
    err = capsys.readouterr().err
    assert err.startswith("iha-convert push: error: ") and "is not an IHA checkpoint folder" in err
    assert "Traceback" not in err


def test_failure_after_writing_started_removes_the_parents_it_created(tiny_source, tmp_path, capsys):
    listing = folder_listing(tmp_path)
    # A tolerance nothing meets: verification fails once the whole folder has been written.
    output = tmp_path / "new" / "deeper" / "out"
    assert convert_command.main([str(tiny_source), str(output), "--quiet", "--tolerance", "1e-30"]) == 1
    assert "Verification failed: NOT exact" in capsys.readouterr().err
    assert folder_listing(tmp_path) == listing


def test_quiet_shows_no_progress_bars(tiny_source, tmp_path, capsys):
    assert convert_command.main([str(tiny_source), str(tmp_path / "out"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.err and "Writing IHA weights" not in captured.err
    assert (
        captured.err.strip()
        == f"{tiny_source} has no tokenizer files, so the converted folder has none either: "
        + ("copy the tokenizer in before using it with pipeline() or pushing it.")
    )
    # Without --quiet the same bars show: the test above would notice them.
    assert convert_command.main([str(tiny_source), str(tmp_path / "out2")]) == 0
    assert "Loading weights" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Settings that change the function are measured where the change happens
# ---------------------------------------------------------------------------------------------------------------


def test_a_changed_window_is_measured_past_the_window(tiny_source, tmp_path, capsys):
    # Training length 64 with P=2 gives a window of 64 / (2 * 2^2) = 8 tokens where the source sees everything.
    output = tmp_path / "out"
    args = [str(tiny_source), str(output), "--layers", "hybrid", "--training-length", "64", "--quiet"]
    assert convert_command.main(args) == 0
    err = capsys.readouterr().err
    report = json.loads((output / REPORT_NAME).read_text())
    by_length = {entry["tokens"]: entry for entry in report["verification"]["by_length"]}
    # tiny_source has no tokenizer: the short batch is random tokens, the long input 512 random tokens (the
    # model's 256 positions cap it at 256).
    assert set(by_length) == {"1-48", "1-8", "9-256"}
    assert by_length["1-8"]["max_abs_diff"] < 1e-5  # inside the window nothing changes
    assert by_length["9-256"]["max_abs_diff"] > 1e-2  # past it the change shows
    assert report["verification"]["max_abs_diff"] == max(entry["max_abs_diff"] for entry in by_length.values())
    assert "one 256-token text, past the 8-token window (tokens 9-256): max |logit difference|" in err
    card = (output / "README.md").read_text()
    assert f"| one 256-token text, past the 8-token window | 9-256 | {by_length['9-256']['max_abs_diff']:.2e} |" in card


@pytest.mark.parametrize(
    "option", [["--position-mode", "virtual"], ["--collapse-init", "mean"], ["--dtype", "bfloat16"]]
)
def test_every_function_change_is_measured_on_a_long_input(tiny_source, tmp_path, option):
    report = convert.convert_checkpoint(
        tiny_source,
        tmp_path / "out",
        show_progress=False,
        **{option[0].removeprefix("--").replace("-", "_"): option[1]},
    )
    assert not report.exact
    halves = [entry for entry in report.verification.by_length if entry["input"].startswith("one 256-token text")]
    assert [entry["tokens"] for entry in halves] == ["1-128", "129-256"]
    assert all(entry["max_abs_diff"] > 0 for entry in halves)


def test_smollm2_hybrid_2048_change_is_measured_past_its_256_token_window(tmp_path):
    """The real SmolLM2 (30 layers): the paper's layout for training length 2048 windows 24 layers at 256 tokens.
    The fixed prompts (at most ~60 tokens) cannot see that; the 512-token input does."""
    report = convert.convert_checkpoint(
        smollm2_dir(), tmp_path / "out", layers="hybrid", training_length=2048, show_progress=False
    )
    by_length = {entry["tokens"]: entry for entry in report.verification.by_length}
    prompts = report.verification.by_length[0]
    assert prompts["max_abs_diff"] < 1e-3 and prompts["top1_agreement"] == 1.0  # the prompts are shorter than 256
    assert by_length["1-256"]["max_abs_diff"] < 1e-3
    assert by_length["257-512"]["max_abs_diff"] > 1.0 and by_length["257-512"]["top1_agreement"] < 0.95
    assert report.verification.max_abs_diff == by_length["257-512"]["max_abs_diff"]
    assert "past the 256-token window (tokens 257-512)" in function_change_warning(report)
