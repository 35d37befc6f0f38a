"""Ending a DeepSpeed training process once its work is written.

Under ZeRO-3 on CPU (gloo), DeepSpeed's engine, its partitioned parameters and its optimizer keep references to the
process groups, so gloo's worker threads are still running when the interpreter tears itself down after `main`
returns. The process can then be ended by the C++ runtime after the model was saved: "terminate called without an
active exception", exit status 134. It was seen once, on rank 1 of a two-process run of `iha sft` in CI, and not
reproduced since; the likely cause is one of those threads outliving the interpreter (dropping a tensor reference
without the GIL, or a joinable thread destroyed at exit). Destroying the process groups (`trainer.end()`) does not
stop them, because the objects above still hold the groups.

`exit_after_deepspeed_run` does what a normal exit does up to that teardown, in CPython's order: it waits for the
process's own non-daemon threads and `concurrent.futures` work (uploads, checkpoint writers), runs the exit handlers
(trackers finish their runs), flushes Python's and C's output buffers, and then exits with the status given, skipping
only the interpreter's final teardown. `iha sft` ends every DeepSpeed run with it; a script of one's own that trains
with DeepSpeed can end with it too (docs/training.md, "DeepSpeed ZeRO-3"). It ends the process: it is the last line
of a script, never a call inside a notebook or a test process.
"""

import atexit
import ctypes
import os
import sys
import threading
from typing import NoReturn


def flush_c_stdio() -> None:
    """Flush the C library's output buffers (what C and C++ extensions printed), which `os._exit` would drop."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to load by name on this platform: nothing buffered there
        pass


def exit_after_deepspeed_run(status: int = 0) -> NoReturn:
    """Exit this process with `status` as a normal exit would, but without the interpreter's final teardown (where
    gloo's still-running threads can abort a finished DeepSpeed process). Call it last, after every collective call
    and every file the process writes; it does not return."""
    # What Py_Finalize does first: join non-daemon threads and run threading's exit callbacks (concurrent.futures
    # waits for its pending work there). gloo's threads are C++ threads, not among them.
    threading._shutdown()
    # Then the handlers registered with atexit: trackers such as wandb finish their runs there, and logging's own
    # handler (`logging.shutdown`, registered when logging is imported) flushes and closes the log handlers.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    flush_c_stdio()
    os._exit(status)


__all__ = ["exit_after_deepspeed_run"]
