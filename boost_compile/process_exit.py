"""How a process of a gloo process group ends: its exit handlers, then ``os._exit``, never
interpreter finalization.

Once ``torch._dynamo`` is imported (the boost backend and DDP import it), the
default process group outlives ``destroy_process_group``: gloo's worker threads
are still running when the interpreter finalizes. One that then releases a
finished collective's tensors needs the GIL for their Python objects; asked for
during finalization, the GIL ends the thread with ``pthread_exit``, whose
unwinding through gloo's destructor aborts the process ("terminate called
without an active exception", SIGABRT). torchrun counts that as a failed worker
(the run that has just completed fails, or is restarted), ``mp.spawn`` as a
failed child. It is a race, lost more often on a loaded machine (a DDP script
with two ranks on one core: 8 of 30 exits aborted). Ending the process after its
exit handlers and before finalization leaves those threads nothing to race with:
torchrun workers end so (``boost-train``), and so do the ``mp.spawn`` workers of
``boost-bench``.
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
