"""Atomic publication of a checkpoint directory."""

from __future__ import annotations

import os
import shutil


def publish_directory(staged: str, final: str) -> None:
    """
    Move a completely written directory `staged` to `final` with renames only, so `final` is never observed
    half-written. An existing `final` (a re-save of the same step) is first moved aside, then deleted.

    Example:

    ```python
    >>> import os, tempfile
    >>> from hf_gradaccum.engine.checkpointing import publish_directory
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(root, "staging", "checkpoint-1"))
    >>> publish_directory(os.path.join(root, "staging", "checkpoint-1"), os.path.join(root, "checkpoint-1"))
    >>> os.listdir(root)
    ['staging', 'checkpoint-1']
    ```
    """
    old = None
    if os.path.exists(final):
        old = staged + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staged, final)
    _fsync_directory(os.path.dirname(os.path.abspath(final)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_directory(path: str) -> None:
    # Makes the rename itself durable on POSIX filesystems (the directory entry is what changed).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
