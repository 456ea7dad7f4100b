"""How a torchrun worker ends: its exit handlers, then ``os._exit``, never interpreter finalization.

DDP keeps its process group alive after ``destroy_process_group`` (its reducer
still holds it), so gloo's worker threads outlive the run. One of them that
releases a finished collective's tensors needs the GIL for their Python objects;
asked for while the interpreter finalizes, the GIL ends the thread with
``pthread_exit``, whose unwinding through gloo's destructor aborts the process
("terminate called without an active exception", SIGABRT). torchrun counts that
as a failed worker: the run that has just completed fails, or is restarted. It is
a race, lost more often on a loaded machine (two ranks on one core: 8 of 30
exits aborted). Ending the process after its exit handlers and before
finalization leaves those threads nothing to race with.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` ends a process with: None is 0, an int itself, anything
    else is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_without_finalizing(code: object) -> NoReturn:
    """End the process with ``sys.exit(code)``'s status: the ``atexit`` handlers run (log files,
    TensorBoard, wandb), stdout and stderr are flushed, and the interpreter is not finalized."""
    status = exit_code(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    os._exit(status)
