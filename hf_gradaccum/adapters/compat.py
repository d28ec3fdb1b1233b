"""Every transformers detail that differs between the supported releases, in one place.

The adapters rely on the Trainer's public contract (`training_step`, `compute_loss`, `get_batch_samples`,
`create_optimizer`/`create_scheduler`, callbacks). Where a private detail is unavoidable, it is reached through a
function here, and `tests/test_compat.py` checks each one against the installed transformers; `.ci/run`'s
compatibility job (`make test-compat`) runs that file, with the parity, fidelity and composition tests, in fresh
virtualenvs with the oldest supported release and a mid-range one.

`check_transformers_version` runs when `hf_gradaccum.adapters` is imported: a release outside
`SUPPORTED_TRANSFORMERS` is refused there, with the range in the message, rather than failing later in a private
name.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from packaging.version import InvalidVersion, Version

# --- helper B ---

# The declared range (keep in step with `dependencies` in pyproject.toml and docs/compatibility.md). The floor is
# TRL's (`trl>=1.16` needs `transformers>=4.56.2`); the ceiling is the first release no test has run against.
TRANSFORMERS_MIN = "4.56.2"
TRANSFORMERS_MAX_EXCLUSIVE = "5.24"
SUPPORTED_TRANSFORMERS = f">={TRANSFORMERS_MIN},<{TRANSFORMERS_MAX_EXCLUSIVE}"


class UnsupportedTransformersError(ImportError):
    """Raised at import of `hf_gradaccum.adapters` when the installed transformers is outside the tested range."""


def check_transformers_version(version: str | None = None) -> str:
    """
    Refuse a transformers release outside [`SUPPORTED_TRANSFORMERS`] with an [`UnsupportedTransformersError`] that
    names the range. `version` defaults to the installed release; returns the version checked.

    Pre-releases and local builds of a supported release (`5.23.0.dev0`, `4.57.6+local`) count as that release: the
    check compares the release number only, so a source checkout of a supported line is accepted.

    Example:

    ```python
    >>> from hf_gradaccum.adapters.compat import check_transformers_version
    >>> check_transformers_version("4.57.6")
    '4.57.6'
    >>> check_transformers_version("4.55.4")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    UnsupportedTransformersError: hf_gradaccum supports transformers>=4.56.2,<5.24; found 4.55.4. ...
    ```
    """
    if version is None:
        version = importlib.metadata.version("transformers")
    try:
        release = Version(Version(version).base_version)
    except InvalidVersion:
        raise UnsupportedTransformersError(
            f"hf_gradaccum supports transformers{SUPPORTED_TRANSFORMERS}; cannot parse the installed version "
            f"{version!r}."
        ) from None
    if not (Version(TRANSFORMERS_MIN) <= release < Version(TRANSFORMERS_MAX_EXCLUSIVE)):
        raise UnsupportedTransformersError(
            f"hf_gradaccum supports transformers{SUPPORTED_TRANSFORMERS}; found {version}. GradAccumTrainer drives "
            "parts of the Trainer's loop that change between releases, and only this range is tested. Install a "
            f'supported release, e.g. `pip install "transformers{SUPPORTED_TRANSFORMERS}"`.'
        )
    return version


def rotate_checkpoints(trainer: Any, output_dir: str, use_mtime: bool = True) -> None:
    """
    Delete `trainer`'s older checkpoints in `output_dir` as the stock Trainer does after a save (`save_total_limit`,
    keeping the best and the newest). Later 5.x releases (5.12.1 and 5.23 among the tested ones) have a module-level
    `trainer_utils.rotate_checkpoints`; 4.x and 5.0.0 only the private method `Trainer._rotate_checkpoints`, which
    reads the same two values (`args.save_total_limit`, `state.best_model_checkpoint`) from the trainer.
    """
    try:
        from transformers.trainer_utils import rotate_checkpoints as module_rotate
    except ImportError:
        trainer._rotate_checkpoints(use_mtime=use_mtime, output_dir=output_dir)
        return
    module_rotate(
        output_dir=output_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=use_mtime,
    )


# The private Trainer/Accelerator names GradAccumTrainer's code reaches today, each with why; `tests/test_compat.py`
# asserts every one exists in the installed release, so a release that renames one fails there, by name, rather than
# deep in a training run. ("Trainer.x": a method or attribute of the class; "args.x": a `TrainingArguments` field;
# "trainer.x": an attribute `Trainer.__init__` or its loop sets on the instance.)
PRIVATE_TRAINER_NAMES = {
    "Trainer._prepare_inputs": "moves each micro-batch to the device before the accumulator's forward",
    "Trainer.compute_loss_context_manager": "the fp16 overflow recompute re-enters the Trainer's loss context",
    "Trainer._get_output_dir": "opt-in `atomic_checkpoints`: points the parent's save at a staging directory",
    "Trainer._save_checkpoint": "opt-in `atomic_checkpoints`: wrapped to publish by rename (no public hook around it)",
    "trainer._train_batch_size": "the out-of-memory retry halves the micro-batch it trains with",
    "args.average_tokens_across_devices": "switched off per micro-batch: the accumulator counts items across ranks",
    "trainer.model_accepts_loss_kwargs": "set to False: the model's own per-micro-batch mean is what is weighted",
    "trainer.accelerator.scaler": "replaced by `WindowGradScaler` (a disabled GradScaler that reports skipped steps): "
    "the accumulator owns fp16 loss scaling",
    "trainer.accelerator.native_amp": "decides whether fp16 autocast must be switched on by hand (CPU)",
}
