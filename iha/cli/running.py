"""What every command line entry point runs its work in: `run_command` turns an error or an interruption into one
line on stderr and the exit status a shell expects, never a traceback."""

import signal
import sys
from collections.abc import Callable

from ..utils.atomic_folders import signals_raise


def run_command(
    prog: str,
    body: Callable[[], int],
    *,
    errors: tuple[type[BaseException], ...] = (),
    interrupted: str = "",
    error_status: int = 2,
) -> int:
    """Run a command line's work: its exit status, with failures reported as one line on stderr, never a traceback.

    `errors` (plus OSError, which names the file and the problem) print `PROG: error: MESSAGE` and exit with
    `error_status` (2, as argparse does for bad arguments); an OSError's message loses its `[Errno N]`.
    Ctrl-C, SIGTERM and SIGHUP print `PROG: interrupted (SIGNAL)` and `interrupted` (what was kept or removed), and
    exit with 128 + the signal number (130 for Ctrl-C), the shell convention.
    """
    with signals_raise():
        try:
            return body()
        except KeyboardInterrupt as interruption:
            signum = getattr(interruption, "signum", signal.SIGINT)
            note = f"; {interrupted}" if interrupted else ""
            print(f"{prog}: interrupted ({signal.Signals(signum).name}){note}", file=sys.stderr, flush=True)
            return 128 + signum
        except (*errors, OSError) as error:
            print(f"{prog}: error: {error_text(error)}", file=sys.stderr, flush=True)
            return error_status


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


__all__ = ["error_text", "run_command"]
