"""KTO's KL baseline made exact under gradient accumulation, for a trainer composed with TRL's `KTOTrainer`.

TRL's KTO loss (`loss_type='kto'`) compares each completion's log-ratio (policy minus reference) with a baseline
`z_0`, an estimate of the KL divergence between policy and reference. `z_0` is estimated from *mismatched* (prompt,
completion) pairs: `KTOTrainer._prepare_dataset` rotates the completions by one within each block of
`per_device_train_batch_size` rows of the (sequentially sampled) dataset, so row i of a batch is paired with the
completion of row i - 1. In the loss, `z_0` is the batch mean of the policy-minus-reference log-probabilities of
those pairs, detached, averaged across ranks and clamped at 0. The loss itself is a mean over the batch's
completions (desirable and undesirable, each multiplied by its class weight).

On one batch of `per_device_train_batch_size x gradient_accumulation_steps x world_size` rows (the large batch this
project reproduces), the completions rotate within all of those rows and `z_0` is one mean over all of their pairs.
Accumulated as stock TRL does it, each micro-batch rotates within its own rows and uses its own mean: a different
objective. Here the window is the batch:

1. **The pairs.** While the composed trainer's `_prepare_dataset` runs (for the train and the eval datasets), the
   `args` object it receives presents `per_device_train_batch_size` as the window's rows over all ranks
   (`b x K x world_size`), and the user's value is put back when the call returns. TRL's own code then builds the
   pairs of the large batch: Accelerate hands global batch i to rank i mod world_size and the Trainer gives each
   rank K consecutive batches per window, so one window over all ranks is exactly one rotation block. The wrapper
   is an instance attribute set in `GradAccumTrainer.__new__`, because `KTOTrainer.__init__` prepares its datasets
   before any other `__init__` of the composition runs when it comes first in the class order.
2. **The baseline.** When the Trainer prefetches a window (`get_batch_samples`), a forward-only pass (no gradients,
   model in train mode, torch RNG state restored afterwards) computes the policy and reference log-probabilities
   of the window's KL pairs with TRL's own `_compute_kl_logps` (the reference as TRL takes it: a separate reference
   model, the PEFT base with the adapter disabled, or the precomputed `ref_KL_logps`). The sum and count of their
   differences are summed over ranks and `z_0 = max(0, sum / count)`: TRL's mean of the per-rank means whenever
   ranks hold the same number of rows (Accelerate's default `even_batches=True` makes them), and the mean over the
   one-process large batch in every case.
3. **The loss.** For the length of each micro-batch's `compute_loss` the trainer's `_compute_kl_logps` is replaced
   by one that returns the window's `z_0` (as policy log-probabilities whose difference from the reference's is
   `z_0`, in float64) without a forward, so TRL's loss uses the window's baseline, and TRL's `kl` metric records
   it. The micro-batch's KL forwards are skipped, so the pre-pass costs what stock TRL already spends on them.

The loss of each micro-batch is then a mean over its completions with a baseline shared by the window, and the
adapter weights it by its completions (rows, as for `apo_zero_unpaired`): the window's update is the large batch's,
up to floating-point summation order (measured in `docs/composition_rl.md`).

Refused at construction (a `ValueError`, with `gradient_accumulation_steps > 1` and a KL term):

- a vision dataset: TRL's vision collator rotates completions within each collated micro-batch, after the dataset
  stage this module controls;
- `auto_find_batch_size=True`: a restart at a smaller batch changes the window after the pairs were built;
- `verify_accumulation` other than `"off"`: the split-invariance probe computes each split's own baseline.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...config.arguments import gradaccum_option
from ...engine.rng import capture_rng_state, restore_rng_state

KTO_TRAINER = "KTOTrainer"
# What TRL 1.16's KTOTrainer provides that this module relies on, and has set before `Trainer.__init__` runs (when
# KTOTrainer comes first in the class order, `GradAccumTrainer.__init__` runs inside it; `ref_model` comes later).
_REQUIRED_NAMES = ("_prepare_dataset", "_compute_kl_logps", "calculate_KL", "precompute_ref_logps")


def _is_kto(trainer: Any) -> bool:
    return any(cls.__name__ == KTO_TRAINER for cls in type(trainer).__mro__)


def _computes_kl(trainer: Any, args: Any) -> bool:
    return bool(getattr(trainer, "calculate_KL", False)) and args.gradient_accumulation_steps > 1


def window_rows(args: Any) -> int:
    """
    Rows of one accumulation window over all ranks, `per_device_train_batch_size x gradient_accumulation_steps x
    world_size`: the rows of the large batch, within which its KL pairs rotate.

    Args:
        args (`TrainingArguments`): the trainer's arguments.

    Returns:
        `int`: the number of rows.
    """
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def install_window_pairing(trainer: Any) -> None:
    """
    Make the KL pairs of a trainer composed with TRL's `KTOTrainer` those of the large batch: an instance attribute
    `_prepare_dataset` that presents `per_device_train_batch_size` as [`window_rows`] on the `args` it is called
    with, for the length of the class's own `_prepare_dataset` (TRL's, or a subclass's), then puts the user's value
    back. It does nothing (calls straight through) without a KL term or at `gradient_accumulation_steps=1`.

    Called from `GradAccumTrainer.__new__`, before any `__init__`; a no-op for trainers without `KTOTrainer`.

    Args:
        trainer: the instance being created.
    """
    if not _is_kto(trainer) or not hasattr(type(trainer), "_prepare_dataset"):
        return
    own = types.MethodType(type(trainer)._prepare_dataset, trainer)

    def _prepare_dataset(dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        if not _computes_kl(trainer, args):
            return own(dataset, processing_class, args, dataset_name)
        per_device = args.per_device_train_batch_size
        rows = window_rows(args)
        args.per_device_train_batch_size = rows
        try:
            prepared = own(dataset, processing_class, args, dataset_name)
        finally:
            args.per_device_train_batch_size = per_device
        trainer.__dict__.setdefault("_kl_rotation_rows", {})[dataset_name] = rows
        return prepared

    trainer._prepare_dataset = _prepare_dataset


class WindowKLBaseline:
    """
    The KL baseline `z_0` of one accumulation window of a composed `KTOTrainer` (see the module docstring): computed
    by [`prepare`] from the window's KL pairs on all ranks, and used by every micro-batch's loss inside
    [`substituted`]. Built by [`window_kl_baseline_for`].

    Attributes:
        kl (`float` or `None`): the prepared window's baseline, clamped at 0 as TRL clamps it (the value the loss
            uses); `None` before the first window.
        raw_kl (`float` or `None`): the same before clamping.
    """

    def __init__(self) -> None:
        self.kl: float | None = None
        self.raw_kl: float | None = None
        self._batches: list[Any] = []

    def __repr__(self) -> str:
        return f"WindowKLBaseline(kl={self.kl!r})"

    @staticmethod
    def _reference_kl_logps(trainer: Any, batch: dict[str, Any]) -> torch.Tensor:
        # The reference's log-probabilities of the KL pairs, taken as TRL's `_compute_loss` takes them.
        if trainer.precompute_ref_logps:
            return batch["ref_KL_logps"]
        from accelerate.utils import is_peft_model
        from trl.models.utils import disable_gradient_checkpointing
        from trl.trainer.utils import use_adapter

        with disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
            if is_peft_model(trainer.model) and trainer.ref_model is None:
                unwrapped = trainer.accelerator.unwrap_model(trainer.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    return trainer._compute_kl_logps(trainer.model, batch)
            return trainer._compute_kl_logps(trainer.ref_model, batch)

    @torch.no_grad()
    def prepare(self, trainer: Any, batches: Sequence[dict[str, Any]]) -> float:
        """
        Forward-only pass over the window's micro-batches: the policy's and the reference's log-probabilities of
        their KL pairs, in train mode (as `training_step` runs them) under the trainer's loss context, the torch RNG
        state restored afterwards. The sum and count of the differences are summed over ranks (one collective per
        window; every rank must call this for every window).

        Args:
            trainer: the composed trainer.
            batches (`Sequence[dict]`): the window's collated micro-batches, as `get_batch_samples` prefetched them.

        Returns:
            `float`: the window's baseline `z_0` (clamped at 0), also kept as `self.kl`.
        """
        model = trainer.model_wrapped if getattr(trainer, "model_wrapped", None) is not None else trainer.model
        device = trainer.accelerator.device
        was_training = model.training
        rng = capture_rng_state()
        differences = []
        model.train()
        try:
            for batch in batches:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                with trainer.compute_loss_context_manager():
                    policy = trainer._compute_kl_logps(model, batch)
                    reference = self._reference_kl_logps(trainer, batch)
                differences.append((policy - reference).double())
        finally:
            restore_rng_state(rng)
            model.train(was_training)
        local = torch.cat(differences) if differences else torch.zeros(0, dtype=torch.float64, device=device)
        totals = torch.stack([local.sum(), torch.tensor(float(local.numel()), dtype=torch.float64, device=device)])
        totals = trainer.accelerator.reduce(totals.to(device), reduction="sum")
        if float(totals[1]) == 0:
            raise RuntimeError("GradAccumTrainer: the window holds no KL pairs on any rank.")
        self.raw_kl = float(totals[0] / totals[1])
        self.kl = max(self.raw_kl, 0.0)
        self._batches = list(batches)
        return self.kl

    def covers_current_micro_batch(self, trainer: Any) -> bool:
        """Whether the micro-batch that `trainer.training_step` is running belongs to the prepared window."""
        index = getattr(trainer, "_micro_index", 0) - 1
        window = getattr(trainer, "_window_batches", [])
        if self.kl is None or not 0 <= index < len(window):
            return False
        return any(window[index] is batch for batch in self._batches)

    @contextlib.contextmanager
    def substituted(self, trainer: Any) -> Iterator[None]:
        """
        For the length of one micro-batch's `compute_loss`: `trainer._compute_kl_logps` returns, without a forward,
        log-probabilities whose mean difference policy minus reference is the window's `z_0`. TRL calls it first for
        the policy, then (unless the reference's come precomputed in the batch as `ref_KL_logps`) for the reference.
        Outside `train()`, a `training_step` on a batch of its own keeps TRL's own per-batch baseline.
        """
        if not self.covers_current_micro_batch(trainer):
            if getattr(trainer, "_training", False):
                raise RuntimeError(
                    f"GradAccumTrainer: the micro-batch {type(trainer).__name__} is training on is not one of the "
                    "window whose KL baseline was computed in `get_batch_samples`, so KTO's baseline would be this "
                    "micro-batch's own, not the large batch's."
                )
            yield
            return
        kl = self.kl
        calls = []

        def window_kl_logps(model: Any, batch: dict[str, Any]) -> torch.Tensor:
            rows = batch["KL_input_ids"].shape[0]
            device = batch["KL_input_ids"].device
            calls.append(model)
            if len(calls) > 1:  # the reference's
                return torch.zeros(rows, dtype=torch.float64, device=device)
            base = (
                batch["ref_KL_logps"].to(device=device, dtype=torch.float64)
                if trainer.precompute_ref_logps
                else torch.zeros(rows, dtype=torch.float64, device=device)
            )
            return base + kl

        trainer._compute_kl_logps = window_kl_logps
        try:
            yield
        finally:
            del trainer._compute_kl_logps


def _refuse(why: str, fix: str) -> ValueError:
    return ValueError(
        f"GradAccumTrainer cannot make KTOTrainer's KL baseline (`loss_type='kto'`) exact under gradient "
        f"accumulation: {why}. {fix}"
    )


def window_kl_baseline_for(trainer: Any) -> WindowKLBaseline | None:
    """
    The [`WindowKLBaseline`] of a trainer composed with TRL's `KTOTrainer` whose loss has a KL term, at
    `gradient_accumulation_steps > 1`; `None` otherwise. Raises a `ValueError` for the configurations the module
    docstring lists as refused, and a `RuntimeError` when the installed TRL lacks what this relies on.

    Args:
        trainer: the composed trainer, after `KTOTrainer.__init__` has prepared its datasets.

    Returns:
        [`WindowKLBaseline`] or `None`.
    """
    if not _is_kto(trainer):
        return None
    missing = [name for name in _REQUIRED_NAMES if not hasattr(trainer, name)]
    if missing:
        raise RuntimeError(
            f"GradAccumTrainer could not find KTOTrainer's {missing}, which it needs to make the KL baseline exact "
            "under accumulation. This TRL release changed them; composition with it is not supported (tested with "
            "trl==1.16)."
        )
    args = trainer.args
    if not _computes_kl(trainer, args):
        return None
    if getattr(trainer, "_is_vision_dataset", False):
        raise _refuse(
            "with a vision dataset TRL's collator rotates the completions within each collated micro-batch, so the "
            "KL pairs are the micro-batch's, not the large batch's",
            "Use `loss_type='apo_zero_unpaired'` (no KL term), or `gradient_accumulation_steps=1` with the batch you "
            "want.",
        )
    if args.auto_find_batch_size:
        raise _refuse(
            "`auto_find_batch_size=True` restarts training at a smaller batch after an out-of-memory error, which "
            "changes the window after its KL pairs were built",
            "Set `auto_find_batch_size=False` and choose `per_device_train_batch_size` yourself.",
        )
    if gradaccum_option(args, "verify_accumulation") != "off":
        raise _refuse(
            "the split-invariance check recomputes the loss on splits of the window, each with its own baseline",
            "Set `verify_accumulation='off'`; this loss's accumulation is known exact (hf_gradaccum/integrations/trl/kto.py).",
        )
    rotation = getattr(trainer, "_kl_rotation_rows", {}).get("train")
    if rotation != window_rows(args):
        raise RuntimeError(
            f"GradAccumTrainer: {type(trainer).__name__}'s train dataset was not prepared with the window's KL pairs "
            f"(rotation over {rotation} rows, expected {window_rows(args)}). Construct the trainer with the dataset, "
            "as `KTOTrainer.__init__` prepares it."
        )
    return WindowKLBaseline()
