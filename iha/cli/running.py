"""What every command line entry point runs its work in: `run_command` turns an error or an interruption into one
line on stderr and the exit status a shell expects, never a traceback.

The exit status of every `iha` command, decided in one place (`exit_status`):

    0        done
    1        the work failed: the input was accepted and the work did not succeed (a conversion that fails its
             verification, an upload the Hub refused, a server that could not start, a full disk)
    2        the input is wrong: a bad flag or flag value, a folder or file that does not exist (or may not be
             written), an unsupported checkpoint, rows of an unknown schema, a package the command needs is missing
    128 + N  stopped by signal N (130 for Ctrl-C, 143 for SIGTERM)

An error of no kind above is a bug: its traceback is kept.
"""

import signal
import sys
from collections.abc import Callable

from ..conversion.errors import ConversionError
from ..utils.atomic_folders import signals_raise
from ..utils.errors import WorkFailedError
from ..utils.optional_packages import missing_package_message


# OSErrors about a path the command was given (to read, or to write into): the input is wrong. Any other OSError (a
# full disk, an I/O error, the network) is work that failed.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


def exit_status(error: BaseException) -> int | None:
    """The exit status of a command that raised `error` (see the module's docstring); None when it is a bug."""
    if isinstance(error, WorkFailedError):
        return 1
    if isinstance(error, ModuleNotFoundError):
        return 2 if missing_package_message(error) is not None else None
    if isinstance(error, (ValueError, ConversionError, *PATH_ERRORS)):
        return 2
    if isinstance(error, OSError):
        return 1
    return None


def report_error(prog: str, error: BaseException) -> int | None:
    """Print `PROG: error: MESSAGE` for an error with an exit status, and return that status; None for a bug."""
    status = exit_status(error)
    if status is not None:
        message = missing_package_message(error) if isinstance(error, ModuleNotFoundError) else error_text(error)
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return status


def run_command(prog: str, body: Callable[[], int], *, interrupted: str = "") -> int:
    """Run a command line's work: its exit status, with failures reported as one line on stderr, never a traceback.

    An error with an exit status (`exit_status`) prints `PROG: error: MESSAGE` (an OSError's message without its
    `[Errno N]`); any other error is a bug and propagates with its traceback. Ctrl-C, SIGTERM and SIGHUP print
    `PROG: interrupted (SIGNAL)` and `interrupted` (what was kept or removed), and exit with 128 + the signal number.
    """
    with signals_raise():
        try:
            return body()
        except KeyboardInterrupt as interruption:
            signum = getattr(interruption, "signum", signal.SIGINT)
            note = f"; {interrupted}" if interrupted else ""
            print(f"{prog}: interrupted ({signal.Signals(signum).name}){note}", file=sys.stderr, flush=True)
            return 128 + signum
        except Exception as error:
            status = report_error(prog, error)
            if status is None:
                raise
            return status


def error_text(error: BaseException) -> str:
    """An error's message, without the `[Errno N]` that OSError puts in front of it (the words say it already)."""
    if not isinstance(error, OSError) or not error.strerror:
        return str(error)
    text = error.strerror
    if error.filename is not None:
        text += f": {error.filename}"
    if error.filename2 is not None:
        text += f" -> {error.filename2}"
    return text


__all__ = ["error_text", "exit_status", "report_error", "run_command"]
