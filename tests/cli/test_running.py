"""How commands report errors and signals: one line on stderr and the shell's exit status."""

import os
import signal
import time

import pytest

from iha.cli.running import exit_status, run_command
from iha.conversion.errors import ConversionError, VerificationFailedError
from iha.hub.push import HubUploadError
from iha.serving.server import ServeError
from iha.utils.optional_packages import MissingPackageError


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

    assert run_command("tool", bad_value) == 2
    assert capsys.readouterr().err == "tool: error: --x must be positive\n"

    def bug():
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):  # a bug is not an input error: its traceback stays
        run_command("tool", bug)


@pytest.mark.parametrize(
    "error, status",
    [
        (ValueError("a bad flag value"), 2),
        (ConversionError("an unsupported checkpoint"), 2),
        (FileNotFoundError(2, "No such file or directory", "rows.jsonl"), 2),
        (FileExistsError(17, "File exists", "out"), 2),
        (MissingPackageError("trl is not installed: pip install 'trl>=1.7'"), 2),
        (VerificationFailedError("Verification failed: NOT exact", report=None), 1),
        (HubUploadError("Uploading failed"), 1),
        (ServeError("the server could not listen on localhost:8000"), 1),
        (PermissionError(13, "Permission denied", "out"), 2),
        (OSError(28, "No space left on device"), 1),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_one_exit_status_rule_input_wrong_2_work_failed_1(error, status, capsys):
    def body():
        raise error

    assert exit_status(error) == status
    assert run_command("tool", body) == status
    err = capsys.readouterr().err
    assert err.startswith("tool: error: ") and err.count("\n") == 1 and "Errno" not in err
