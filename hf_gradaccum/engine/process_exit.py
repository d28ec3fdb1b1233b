"""A clean exit for finished multi-process scripts on gloo (CPU data parallelism).

Why: with gloo, the worker thread that ran a collective drops its reference to the collective's tensors a moment
*after* the caller's `wait()` has returned. If that release needs the GIL (the tensor's Python object is already
gone) while the interpreter is tearing down, the thread is unwound inside a C++ destructor and the process aborts
with `terminate called without an active exception` (SIGABRT), after all of its work succeeded. Measured on torch
2.13: 4 aborts in 37 runs of `recipes/plain_accelerate_loop.py` on 2 processes, after the ranks had destroyed their
process group (and the FSDP2 test worker aborted so after a barrier and `destroy_process_group`; a core dump shows the worker thread in
`~AsyncAllreduceWork` while the main thread is in `Py_FinalizeEx`; torch's tracker: pytorch/pytorch#179291).
The tensors can belong to any library (DDP buckets, FSDP2 gathers, a Trainer's metric gathers), so the only exit
that cannot race is one that skips the interpreter's teardown.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch


def leave_process_group_and_exit(code: int = 0) -> NoReturn:
    """End a finished script: wait for every rank, destroy the process group, flush the output and the logs, and
    exit with `code` without the interpreter's teardown (see the module docstring for why).

    In a process group it skips `atexit` handlers, so call it only as the last line of a script, after trackers and
    files are closed. Without a process group it is an ordinary `sys.exit(code)`.

    Example:

    ```python
    >>> if __name__ == "__main__":
    ...     main()
    ...     leave_process_group_and_exit(0)
    ```
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        sys.exit(code)  # no gloo threads to race: the ordinary exit, `atexit` handlers included
    torch.distributed.barrier()  # no rank tears the group down under a slower one
    torch.distributed.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
