"""Every transformers detail that differs between the supported releases, in one place.

The adapters rely on the Trainer's public contract (`training_step`, `compute_loss`, `get_batch_samples`,
`create_optimizer`/`create_scheduler`, callbacks). Where a private detail is unavoidable, it is reached through a
function here, and `tests/test_compat.py` checks each one against the installed transformers; `.ci/run`'s
compatibility job (`make test-compat`) runs that file, with the parity, fidelity and composition tests, in fresh
virtualenvs with the oldest supported stack, a current CUDA image's stack and the newest releases.

`check_transformers_version` runs when `hf_gradaccum.trainer` is imported: a release older than the supported floor
is refused there, with the floor in the message; a release newer than the newest tested one is accepted with one
logged warning (`hf_gradaccum.versions`). A private name that a future release removes fails at the feature that
needs it (`require_private_names`), with the feature and the release in the message, never at import.
"""

from __future__ import annotations

from typing import Any

from ..versions import TESTED, UnsupportedVersionError, check_version

TRANSFORMERS_MIN = TESTED["transformers"].oldest
SUPPORTED_TRANSFORMERS = TESTED["transformers"].requirement

# Kept as the name callers catch; an `ImportError`, like every version refusal of the package.
UnsupportedTransformersError = UnsupportedVersionError


def check_transformers_version(version: str | None = None) -> str:
    """
    Refuse a transformers release older than [`SUPPORTED_TRANSFORMERS`] with an [`UnsupportedTransformersError`] that
    names the floor; accept a newer one than the newest tested, with one logged warning. `version` defaults to the
    installed release; returns the version checked.

    Example:

    ```python
    >>> from hf_gradaccum.config.compat import check_transformers_version
    >>> check_transformers_version("4.57.6")
    '4.57.6'
    >>> check_transformers_version("4.55.4")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    UnsupportedVersionError: GradAccumTrainer needs transformers>=4.56.2; found 4.55.4. ...
    ```
    """
    return check_version("transformers", "GradAccumTrainer", version)


class MissingTransformersFeatureError(RuntimeError):
    """A private Trainer/Accelerator name a feature needs is missing from the installed transformers/accelerate."""


def require_private_names(trainer: Any, names: list[str], feature: str) -> None:
    """
    Raise [`MissingTransformersFeatureError`] naming `feature`, the missing names and the installed releases when
    `trainer` (a constructed `Trainer`) lacks one of `names` (keys of [`PRIVATE_TRAINER_NAMES`]). Called when a
    feature is switched on, so a release that renames a private detail breaks only the feature that uses it.
    """
    from transformers import Trainer

    missing = [name for name in names if not _has_private_name(trainer, Trainer, name)]
    if missing:
        import accelerate
        import transformers

        raise MissingTransformersFeatureError(
            f"{feature} needs {', '.join(missing)}, which transformers {transformers.__version__} / accelerate "
            f"{accelerate.__version__} no longer provide (newest tested: transformers {TESTED['transformers'].newest},"
            f" accelerate {TESTED['accelerate'].newest}). Install a tested release, turn the feature off, or report "
            "it with the output of `hf-gradaccum env`."
        )


def _has_private_name(trainer: Any, trainer_class: type, name: str) -> bool:
    owner, _, attribute = name.partition(".")
    if owner == "Trainer":
        return hasattr(trainer_class, attribute)
    if owner == "args":
        return hasattr(trainer.args, attribute)
    target = trainer
    for part in name.split(".")[1:]:
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


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


def trainer_reads_loss_is_scaled_for_ga() -> bool:
    """
    Whether the installed `Trainer.training_step` reads `loss_is_scaled_for_ga` (transformers 5.19 and later), the
    attribute transformers documents for subclasses that compute their own loss: `True` means the loss is used as it
    is, not divided by `current_gradient_accumulation_steps`. Older releases decide from `model_accepts_loss_kwargs`
    and `compute_loss_func` alone, and divide whenever there is no `compute_loss_func`.
    """
    from transformers import Trainer

    return hasattr(Trainer, "loss_is_scaled_for_ga")


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
    "args.average_tokens_across_devices": "read: with a `compute_loss_func`, the micro-batch's count is handed over "
    "as every rank's, as the Trainer expects when it is on",
    "trainer.model_accepts_loss_kwargs": "set to False: the model's own per-micro-batch mean is what is weighted",
    "trainer.accelerator.scaler": "replaced by `WindowGradScaler` (a disabled GradScaler that reports skipped steps): "
    "the accumulator owns fp16 loss scaling",
    "trainer.accelerator.native_amp": "decides whether fp16 autocast must be switched on by hand (CPU)",
}

# What each feature needs of `PRIVATE_TRAINER_NAMES`, checked when the feature is switched on.
ATOMIC_CHECKPOINT_PRIVATE_NAMES = ["Trainer._get_output_dir", "Trainer._save_checkpoint"]
CORE_PRIVATE_NAMES = [name for name in PRIVATE_TRAINER_NAMES if name not in ATOMIC_CHECKPOINT_PRIVATE_NAMES]
