"""Opt-in atomic checkpoint writes (`atomic_checkpoints=True`): a crash while saving never leaves a half-written
`checkpoint-N`.

transformers has no public hook around a checkpoint save (callbacks' `on_save` runs after the files are written), so
this is the one place that redirects the private `Trainer._get_output_dir` while the parent's `_save_checkpoint`
runs: the checkpoint is written into a staging folder, then renamed into place. Best-model tracking is then redone
on the published path exactly as the stock Trainer does it, and checkpoints are rotated in the real run directory.
Off by default, so a default run saves exactly as the stock Trainer does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config.compat import rotate_checkpoints

STAGING_DIR_NAME = ".incomplete-checkpoints"


def save_checkpoint_atomically(trainer: Any, save: Callable[[], None], trial: Any) -> None:
    """Run `save` (the parent's `_save_checkpoint`) into a staging folder, then publish `checkpoint-N` by rename."""
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging_root = os.path.join(run_dir, STAGING_DIR_NAME)
    staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
    if trainer.args.should_save and os.path.isdir(staged):
        shutil.rmtree(staged)  # left by a crash during an earlier save
    trainer.accelerator.wait_for_everyone()
    previous_best = trainer.state.best_model_checkpoint
    trainer._get_output_dir = lambda trial=None: staging_root
    try:
        save()
    finally:
        del trainer._get_output_dir
    trainer.accelerator.wait_for_everyone()  # every rank's files are in the staged directory
    if trainer.args.should_save:
        publish_directory(staged, final)
        with contextlib.suppress(OSError):
            os.rmdir(staging_root)  # only when empty: never leave a stray folder in output_dir
    # The parent looked for the best checkpoint in the staging folder; look again where it really is (as stock).
    trainer.state.best_model_checkpoint = previous_best
    best_step = getattr(trainer.state, "best_global_step", None)
    if best_step:
        best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        if os.path.exists(best_dir):
            trainer.state.best_model_checkpoint = best_dir
    if trainer.args.should_save:
        trainer.state.save_to_json(os.path.join(final, "trainer_state.json"))
        rotate_checkpoints(trainer, run_dir)
    trainer.accelerator.wait_for_everyone()


def publish_directory(staged: str, final: str) -> None:
    """
    Move a completely written directory `staged` to `final` with renames only, so `final` is never observed
    half-written. An existing `final` (a re-save of the same step) is first moved aside, then deleted.

    Example:

    ```python
    >>> import os, tempfile
    >>> from hf_gradaccum.trainer.atomic_checkpoints import publish_directory
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
