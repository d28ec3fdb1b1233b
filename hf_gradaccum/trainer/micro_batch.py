"""One micro-batch of a window through the parent classes' own `training_step`, read top-down.

`GradAccumTrainer._accumulate` builds a [`MicroBatchRun`] per micro-batch (per chunk after an out-of-memory split) and
calls its `run`, which goes, in order:

1. `run`: present the Trainer's step counter as one step where the release would divide by it, install the loss
   handover, and open the accumulator's micro-batch context (its hooks fold the gradients of the coming backward);
2. `parent_step`: the parents' own `training_step`, unpatched (TRL's activation-offloading context, any context a
   subclass adds, then `Trainer.training_step`'s `_prepare_inputs`, forward, `compute_loss` and
   `accelerator.backward`, each once);
3. `present`, called at the loss (`losses/counting.py`): `count` the items of the inputs the loss sees, `begin` the
   accumulator's micro-batch with them, and install the window statistics the loss reads;
4. `hand_over`, called where Accelerate back-propagates: the accumulator's tensor for the loss (fp16 loss scaling;
   FSDP2, whose reduce-scatter sums the ranks' gradients before the fold);
5. `check_ran`: refuse, before anything reaches a step, a parent `training_step` that did not run one micro-batch as
   `Trainer.training_step` does;
6. `recompute`, after an fp16 overflow: only this micro-batch's `compute_loss` and backward again.

The parent's `compute_loss` returns the micro-batch's own mean loss, which the accumulator weights by its share of the
window's items: it gets no `num_items_in_batch` (so the model, a label smoother and TRL's SFTTrainer take the
micro-batch's own mean), except a `compute_loss_func`, which divides by what it is given ([`num_items_for_parent`]).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..engine.accumulator import GradientAccumulator
from ..losses.counting import counting_at_the_loss, parent_step_is_users
from .loop_calls import counting_step_reads
from .loss_handover import backward_through
from .step_gating import WindowGradScaler

Undo = Callable[[], None]


def _nothing_to_undo() -> None:
    """What counting installs when it installs nothing."""


def _undo_all(undos: list[Undo]) -> None:
    """Undo what presenting a loss's inputs installed, last first."""
    for undo in reversed(undos):
        undo()


@contextlib.contextmanager
def presented_as_one_step(trainer: Any) -> Iterator[None]:
    """Present `current_gradient_accumulation_steps` as 1 while the parents' `training_step` runs, on transformers
    releases before 5.19, whose `training_step` divides the loss by it (later ones read `loss_is_scaled_for_ga`)."""
    if not trainer._present_one_step:
        yield
        return
    steps = getattr(trainer, "current_gradient_accumulation_steps", None)
    trainer.current_gradient_accumulation_steps = 1
    try:
        yield
    finally:
        if steps is None:
            del trainer.current_gradient_accumulation_steps
        else:
            trainer.current_gradient_accumulation_steps = steps


def num_items_for_parent(trainer: Any, num_items: float | None, handed: bool = False) -> torch.Tensor | None:
    """
    `num_items_in_batch` for the parent's `training_step`: `None`, so that each loss is its micro-batch's own mean. A
    `compute_loss_func` (or, with `handed=True`, a trainer's loss that divides by the count it is handed) divides by
    what it is given, so it gets the micro-batch's own count; with `average_tokens_across_devices` on, the Trainer
    multiplies the loss by the number of processes (it takes the count to span every rank, as its own does), so the
    count is handed over as every rank's.
    """
    # TRL (transformers < 5.19) stores a non-callable marker here to switch the Trainer's division off.
    if num_items is None or not (handed or callable(trainer.compute_loss_func)):
        return None
    ranks = trainer.accelerator.num_processes if trainer.args.average_tokens_across_devices else 1
    return torch.tensor(num_items * ranks, device=trainer.args.device)


class MicroBatchRun:
    """
    One micro-batch (or one chunk of it) through the parents' own `training_step`, between the accumulator's
    `begin_micro_batch` and `end_micro_batch`, whose hooks fold the gradients of its backward weighted by its items.

    Args:
        trainer: the `GradAccumTrainer` running the window.
        model: the model its `training_step` was handed.
        accumulator ([`GradientAccumulator`]): the window's accumulator.
        inputs: the micro-batch as the Trainer's loop handed it.
        num_items (`float`, *optional*): its items as counted when the window was prefetched, where the loss provably
            sees that very batch; otherwise they are counted on the inputs that reach `compute_loss`.

    Example:

    ```python
    >>> loss, items = MicroBatchRun(trainer, model, accumulator, inputs, None).run()  # doctest: +SKIP
    ```
    """

    def __init__(
        self,
        trainer: Any,
        model: nn.Module,
        accumulator: GradientAccumulator,
        inputs: Any,
        num_items: float | None,
        continues: float | None = None,
    ) -> None:
        self.trainer = trainer
        # One more loss of the micro-batch of this many items (a user's `training_step` calling `super()` again).
        self.continues = continues
        self.model = model
        self.accumulator = accumulator
        self.inputs = inputs
        self.num_items = num_items
        # A trainer that generates or rebuilds its batch inside the micro-step counts it its own way.
        self.rule = trainer._generation_accumulation
        self.parent_items = num_items_for_parent(trainer, num_items, handed=bool(trainer._handed_count))
        if trainer._stock_num_items is not None:
            # A user's `compute_loss` sees what the stock Trainer hands it; the settled rule weights what it returns.
            self.parent_items = trainer._stock_num_items
        self.counted: list[float] = []
        self.handed_over = 0
        # A backward handed over while `compute_loss` runs (a user's loss that back-propagates itself).
        self.in_loss = False
        self.inside_loss: float | None = None
        self.returned_loss: Any = None
        # A user's class runs between this class and `Trainer.training_step` (one that may divide by the steps).
        self.user_step = parent_step_is_users(type(trainer))
        self.steps_read = 0

    def run(self) -> tuple[torch.Tensor, float]:
        """Run the micro-batch, again after each fp16 overflow; return its detached mean loss and its items."""
        trainer, accumulator = self.trainer, self.accumulator
        with presented_as_one_step(trainer):
            trainer._install_loss_handover(accumulator)
            try:
                trainer._hand_over = self.hand_over
                trainer._in_micro_step = True
                # No DDP all-reduce for any micro-batch (the last one included): the accumulator reduces its flat
                # buffer once per window.
                with (
                    accumulator.accumulate(self.model),
                    self.backward_handover(),
                    counting_at_the_loss(
                        trainer, self.present, self.begin, self.items_for_loss, returned=self.loss_returned
                    ) as seen,
                ):
                    trainer._seen_inputs = seen
                    loss = self.parent_step()
                    self.check_ran()
                    while accumulator.end_micro_batch(loss):
                        loss = self.recompute()
            finally:
                trainer._in_micro_step = False
                trainer._hand_over = None
                trainer._seen_inputs = []
        return loss, self.counted[0]

    def backward_handover(self) -> contextlib.AbstractContextManager:
        """Where the in-place path weights the loss when no `WindowGradScaler` hands it over: the Accelerator's
        `backward`, for this micro-batch only."""
        # (A user's class around `Trainer.training_step` is routed too: its division by the steps is undone there.)
        routed = self.accumulator.in_place or self.user_step
        if routed and not isinstance(self.trainer.accelerator.scaler, WindowGradScaler):
            return backward_through(self.trainer.accelerator, self.hand_over)
        return contextlib.nullcontext()

    def parent_step(self) -> torch.Tensor:
        """The parents' own `training_step`; Online DPO computes and back-propagates its loss without `compute_loss`,
        so its micro-batch is counted as handed."""
        rule, trainer = self.rule, self.trainer
        if getattr(rule, "loss_inside_training_step", False):
            self.begin(rule.count_handed(self.inputs))
            self.in_loss = False  # its backward is the step's own, not one inside `compute_loss`
            return rule.returned_loss(trainer, rule.parent_step(trainer, self.model, self.inputs, self.parent_items))
        if not self.user_step:
            return trainer._parents_training_step(self.model, self.inputs, self.parent_items)
        # A user's step that back-propagates by itself may divide by the accumulation steps: whether it read them.
        with counting_step_reads(trainer) as reads:
            try:
                return trainer._parents_training_step(self.model, self.inputs, self.parent_items)
            finally:
                self.steps_read = reads.reads

    def loss_returned(self, result: Any) -> None:
        """`compute_loss` returned `result` (a loss, or a loss and outputs)."""
        self.in_loss = False
        self.returned_loss = result[0] if isinstance(result, tuple) else result

    def begin(self, items: float) -> None:
        """Open the micro-batch in the accumulator with its items, once (an fp16 recompute presents it again)."""
        self.in_loss = True
        if self.counted:
            return
        self.counted.append(items)
        if self.continues is None:
            self.accumulator.begin_micro_batch(items, can_recompute=True)
            return
        if float(items) != float(self.continues):
            raise RuntimeError(
                f"GradAccumTrainer stopped before the optimizer step: {type(self.trainer).__name__}.training_step "
                f"called `super().training_step(...)` again within one micro-batch with a batch of {float(items):g} "
                f"items where the first call's had {float(self.continues):g}. Each loss is a mean over its own "
                "items, whose window total is known only at the window's end: return both losses from one "
                "`compute_loss`, or declare their counts with `count_micro_batch_items` and `mean_terms`."
            )
        self.accumulator.begin_micro_batch(items, can_recompute=True, continues=True)

    def count(self, loss_inputs: Any) -> tuple[float, Undo]:
        """The items of the inputs the loss sees, and how to undo what counting them installed."""
        if self.rule is not None:
            return self.rule.present(self.trainer, loss_inputs)
        if self.num_items is not None:
            return self.num_items, _nothing_to_undo
        if self.counted:  # recomputed after an fp16 overflow: the same inputs, already counted
            return self.counted[0], _nothing_to_undo
        return self.trainer._declared_items(loss_inputs), _nothing_to_undo

    def present(self, loss_inputs: Any) -> tuple[float, Undo]:
        """Count the loss's inputs and install the window statistics its loss reads (entropy threshold, term weights,
        the window's sort); return the items and how to undo the installation."""
        items, restore = self.count(loss_inputs)
        trainer = self.trainer
        if not trainer._training:
            return items, restore
        undos = [restore]
        try:
            if trainer._entropy_quantile is not None:
                # First: the window's threshold also says how many tokens an entropy bonus is a mean over.
                undos.append(trainer._entropy_quantile.present(trainer))
            if trainer._loss_terms is not None:
                undos.append(trainer._loss_terms.scale(trainer, loss_inputs, items))
            if trainer._sorted_loss is not None:
                # (The batch the loop handed over: the loss's own inputs are its copy on the device.)
                undos.append(trainer._sorted_loss.present(trainer, self.inputs))
        except BaseException:
            _undo_all(undos)  # nothing the loss would have seen stays installed
            raise
        return items, functools.partial(_undo_all, undos)

    def items_for_loss(self, items: float) -> torch.Tensor | None:
        """`num_items_in_batch` for the parent's `compute_loss`, once the items are counted."""
        if self.trainer._handed_count or self.trainer._stock_num_items is not None:
            return self.parent_items
        return num_items_for_parent(self.trainer, items)

    def hand_over(self, loss: torch.Tensor) -> torch.Tensor:
        """What Accelerate back-propagates for this micro-batch's loss: the accumulator's tensor for it. A loss
        without a graph after a backward of this micro-batch (`compute_loss` back-propagated itself and returned the
        loss detached) back-propagates nothing."""
        if not loss.requires_grad and self.handed_over:
            return torch.zeros((), device=loss.device, requires_grad=True)
        self.handed_over += 1
        if self.in_loss:
            self.inside_loss = float(loss.detach())
        undone = self.undone_division(loss) if self.user_step else 1.0
        return self.accumulator.loss_to_backward(loss * undone if undone != 1.0 else loss)

    def undone_division(self, loss: torch.Tensor) -> float:
        """A user's `training_step` that divides what `compute_loss` returned by the accumulation steps before
        handing it to `accelerator.backward` (the shape written for the stock Trainer) has the division undone: the
        accumulator weights the micro-batch's own mean. 1 where the loss is `compute_loss`'s own."""
        returned = self.returned_loss
        if returned is None or not self.user_step or not torch.is_tensor(returned) or returned.numel() != 1:
            return 1.0
        value, handed = float(returned.detach()), float(loss.detach())
        trainer = self.trainer
        steps = {trainer.args.gradient_accumulation_steps, getattr(trainer, "current_gradient_accumulation_steps", 1)}
        for k in sorted(s for s in steps if s and s > 1):
            if value != 0 and abs(handed * k - value) <= 1e-6 * abs(value):
                return float(k)
        return 1.0

    def check_ran(self) -> None:
        """Refuse, before anything is folded into a step, a parent `training_step` that did not run one micro-batch
        as `Trainer.training_step` does: the weighting would silently be wrong."""
        name = type(self.trainer).__name__
        if not self.counted:
            raise RuntimeError(
                f"{name}: the parent classes' `training_step` returned without calling `compute_loss`, so "
                "GradAccumTrainer could not count the items of the micro-batch its loss saw."
            )
        if self.handed_over > 1:
            raise RuntimeError(
                f"{name}.training_step called `accelerator.backward` twice for one micro-batch; "
                "GradAccumTrainer can weight only one loss per micro-batch. Return the sum from `compute_loss`."
            )
        if self.inside_loss is not None:
            self.check_backward_inside_loss(name)
        if self.user_step and not self.handed_over and self.steps_read:
            raise RuntimeError(
                f"GradAccumTrainer stopped before the optimizer step: the `training_step` of {name}'s parent "
                "classes reads the accumulation steps and back-propagates with `loss.backward()`, so GradAccumTrainer "
                "cannot see whether it divided the loss by them. Call `self.accelerator.backward(loss)` there instead "
                "(a division by the accumulation steps is then undone, and the micro-batch weighted by its share of "
                "the window)."
            )
        micro = self.accumulator.current_micro_batch
        # A backward of the loss as it is suffices where the accumulator would not change it (fp32, replicated
        # buffers); under fp16 loss scaling or FSDP2 it must pass through `accelerator.backward`.
        if not self.handed_over and not (micro.gradients_arrived and self.accumulator.loss_factor_is_one):
            raise RuntimeError(
                f"The training_step of {name}'s parent classes returned without calling "
                "`self.accelerator.backward(loss)`, so GradAccumTrainer could not weight and accumulate the "
                "gradient (under fp16 loss scaling or FSDP2 the loss must be handed to the Accelerator). Compose "
                "GradAccumTrainer only with trainers whose training_step ends in `Trainer.training_step` "
                "(SFTTrainer, DPOTrainer, RewardTrainer, Seq2SeqTrainer do)."
            )

    def check_backward_inside_loss(self, name: str) -> None:
        """`compute_loss` handed a loss to `accelerator.backward` itself: exact where that is the loss it returns (the
        accumulator weighted it); anything else is refused with what to change."""
        returned, handed = self.returned_loss, self.inside_loss
        value = float(returned.detach()) if torch.is_tensor(returned) and returned.numel() == 1 else None
        if value is not None and abs(handed - value) <= 1e-6 * max(abs(value), 1e-30):
            return
        args = self.trainer.args
        divided = value is not None and args.gradient_accumulation_steps > 1
        if divided and abs(handed * args.gradient_accumulation_steps - value) <= 1e-6 * abs(value):
            change = (
                "it divides the loss by `gradient_accumulation_steps` before its backward, where GradAccumTrainer "
                "weights each micro-batch's own mean by its share of the window: drop the division (or return the "
                "loss and leave the backward to the Trainer)"
            )
        else:
            change = (
                f"it back-propagated {handed:.6g} and returned {value if value is not None else returned!r}, so "
                "GradAccumTrainer cannot tell what its weight reached: return the loss it back-propagates, or "
                "return the loss and leave the backward to the Trainer"
            )
        raise RuntimeError(
            f"GradAccumTrainer stopped before the optimizer step: {name}.compute_loss calls `accelerator.backward` "
            f"inside itself, and {change}."
        )

    def recompute(self) -> torch.Tensor:
        """
        fp16 overflow: this micro-batch's forward and backward again, at the backed-off scale, through the public
        `compute_loss` and `accelerator.backward`, on the inputs its first forward's loss saw (a generation batch's
        buffered completions, not new ones; the counting `compute_loss` still installed presents them again).
        Returns the detached loss.
        """
        trainer = self.trainer
        again_inputs = trainer._seen_inputs[0] if trainer._seen_inputs else trainer._prepare_inputs(self.inputs)
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(self.model, again_inputs, num_items_in_batch=self.parent_items)
        if trainer.args.n_gpu > 1:
            loss = loss.mean()
        trainer.accelerator.backward(loss)
        return loss.detach()
