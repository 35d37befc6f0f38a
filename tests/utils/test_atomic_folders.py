"""The staging folder every command writes through, and how commands report errors and signals."""

import fcntl
import os
import signal
import time

import pytest

from iha.atomic_folders import LOCK_NAME, remove_stale_staging, run_command, staged_folder


def listing(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_finished_folder_is_renamed_into_place_without_the_lock(tmp_path):
    destination = tmp_path / "new" / "out"
    with staged_folder(destination, "tool") as staging:
        assert staging.parent == destination.parent and staging.name.startswith(".out.tool-")
        (staging / "weights.bin").write_text("complete")
    assert listing(destination) == ["weights.bin"]
    assert listing(destination.parent) == ["out"]
    assert oct(destination.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_a_failure_removes_the_staging_folder_and_the_parents_it_created(tmp_path):
    (tmp_path / "kept").mkdir()
    destination = tmp_path / "kept" / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        with staged_folder(destination, "tool") as staging:
            (staging / "half.bin").write_text("half")
            raise RuntimeError("disk full")
    assert listing(tmp_path) == ["kept"] and listing(tmp_path / "kept") == []


def test_an_existing_folder_is_replaced_only_when_asked_and_only_once_complete(tmp_path):
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "mine.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        with staged_folder(destination, "tool") as staging:
            (staging / "new.txt").write_text("new")
    assert listing(tmp_path) == ["out"] and listing(destination) == ["mine.txt"]

    with pytest.raises(KeyboardInterrupt):
        with staged_folder(destination, "tool", replace=True) as staging:
            (staging / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert listing(tmp_path) == ["out"] and listing(destination) == ["mine.txt"]

    with staged_folder(destination, "tool", replace=True) as staging:
        (staging / "new.txt").write_text("new")
    assert listing(tmp_path) == ["out"] and listing(destination) == ["new.txt"]


def test_only_provably_abandoned_staging_folders_are_removed(tmp_path, caplog):
    destination = tmp_path / "out"
    abandoned = tmp_path / ".out.tool-abandoned"  # what a SIGKILLed run leaves: its lock file, held by nobody
    abandoned.mkdir()
    (abandoned / LOCK_NAME).touch()
    (abandoned / "model.safetensors").write_text("half")
    in_use = tmp_path / ".out.tool-in-use"  # a run still writing holds its lock
    in_use.mkdir()
    (in_use / LOCK_NAME).touch()
    holder = os.open(in_use / LOCK_NAME, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    unknown = tmp_path / ".out.tool-unknown"  # no lock file: not provably ours
    unknown.mkdir()
    other_tool = tmp_path / ".out.other-abandoned"
    other_tool.mkdir()
    (other_tool / LOCK_NAME).touch()
    try:
        with caplog.at_level("WARNING", logger="iha.atomic_folders"):
            assert remove_stale_staging(destination, "tool") == [abandoned]
        assert "Removed 1 staging folder(s) that a killed earlier run of tool left" in caplog.text
        assert "still writing" in caplog.text
        assert listing(tmp_path) == [".out.other-abandoned", ".out.tool-in-use", ".out.tool-unknown"]
    finally:
        os.close(holder)


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler for the test. A job started in the background without job control (`make test &`,
    some CI runners) inherits an ignored SIGINT, which run_command rightly leaves ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_run_command_reports_signals_and_errors_in_one_line(capsys, python_ctrl_c):
    def signalled(signum):
        def body():
            os.kill(os.getpid(), signum)
            time.sleep(60)  # the handler interrupts this at once
            return 0

        return body

    handler_before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or whatever an earlier test's library installed
    assert run_command("tool", signalled(signal.SIGTERM), interrupted="nothing was written") == 143
    assert capsys.readouterr().err == "tool: interrupted (SIGTERM); nothing was written\n"
    assert run_command("tool", signalled(signal.SIGINT)) == 130
    assert capsys.readouterr().err == "tool: interrupted (SIGINT)\n"
    assert signal.getsignal(signal.SIGTERM) == handler_before  # restored afterwards

    def missing_file():
        open("/nonexistent/file")

    assert run_command("tool", missing_file) == 2
    assert capsys.readouterr().err == "tool: error: No such file or directory: /nonexistent/file\n"

    def bad_value():
        raise ValueError("--x must be positive")

    assert run_command("tool", bad_value, errors=(ValueError,), error_status=1) == 1
    assert capsys.readouterr().err == "tool: error: --x must be positive\n"

    def bug():
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):  # a bug is not an input error: its traceback stays
        run_command("tool", bug, errors=(ValueError,))
