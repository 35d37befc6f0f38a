"""Ending a DeepSpeed training process once its work is written.

Under ZeRO-3 on CPU (gloo), DeepSpeed's engine, its partitioned parameters and its optimizer keep references to the
process groups, so gloo's worker threads are still running when the interpreter tears itself down after `main`
returns. One of them can then drop the last reference to a tensor while the finalising interpreter no longer hands
out the GIL, and the C++ runtime ends the process: "terminate called without an active exception", exit status 134,
after the model was saved. It was seen once on rank 1 of a two-process run of `iha sft` in CI; destroying the process
groups (`trainer.end()`) does not stop those threads, because the objects above still hold the groups.

`exit_after_deepspeed_run` skips only that teardown: the exit handlers still run (trackers finish their runs), the
output streams and logs are flushed, and the process exits with the status given. `iha sft` ends every DeepSpeed run
with it; a script of one's own that trains with DeepSpeed can end with it too (docs/training.md, "DeepSpeed ZeRO-3").
"""

import atexit
import logging
import os
import sys
from typing import NoReturn


def exit_after_deepspeed_run(status: int = 0) -> NoReturn:
    """Exit this process with `status` after its exit handlers, without the interpreter's final teardown (where
    gloo's still-running threads can abort a finished DeepSpeed process). Call it last, after every collective call
    and every file the process writes."""
    # The handlers registered with atexit (trackers such as wandb finish their runs there) run now, as at any exit.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


__all__ = ["exit_after_deepspeed_run"]
