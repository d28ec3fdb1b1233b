"""A user's `training_step` override, one loop call at a time: the window follows the Trainer's loop.

A `Trainer` subclass that overrides `training_step` wraps `GradAccumTrainer.training_step` in code of its own: it may
call `super()` once, twice (the batch and an augmented copy), or never (the stock body copied, an older shape, a step
of its own), and read or change `.grad` after it. For the length of `train()` such a trainer gets an instance attribute
`training_step` (which shadows every class of the MRO: the loop calls `self.training_step`), a [`LoopCalls`]. Each call
the loop makes is one micro-batch ([`LoopCall`]):

- `super()` once: the micro-batch, as without the override. Code after it sees, in the middle of a window, the window's
  mean so far as copies that cannot reach the step (`engine/presented_gradients.py`), and on the window's last
  micro-batch the window's gradient, as code after the large batch's backward does.
- `super()` again: one more loss of the same micro-batch, weighted alike (a window that already ended on the last
  micro-batch is reopened).
- never: the override back-propagates itself, as under the stock Trainer. While it runs, the accumulation divisor it
  reads (`args.gradient_accumulation_steps`, `current_gradient_accumulation_steps`, with `loss_is_scaled_for_ga` off)
  is the micro-batch's exact share of the window, `N / n` (its items `n` of the window's `N`), so that its own
  division gives the large batch's step.

What cannot be the large batch's step stops before the optimizer steps, with the window discarded and the reason
([`OverrideStop`]): parameters changed inside a window of several micro-batches (FGM, AWP, SAM move the weights along
a micro-batch's gradient; the large batch moves them along the whole batch's), a backward outside `super()` in a call
that also ran it, bypassed and accumulated micro-batches in one window, a bypass under several processes, a bypass that
back-propagated without reading the accumulation steps.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..engine.presented_gradients import PresentedGradients, gradient_fingerprint
from ..losses.accumulation_check import CHECK_FILE_NAME
from ..losses.counting import user_classes_around_training_step
from .loss_handover import backward_through

logger = logging.getLogger(__name__)

BYPASSED = "bypassed"
ACCUMULATED = "accumulated"


class OverrideStop(RuntimeError):
    """A `training_step` override whose step cannot equal the large batch's, stopped before the optimizer step."""


def _parameter_fingerprint(parameters: list[nn.Parameter]) -> list[tuple[int, int]]:
    """Each parameter's storage and version: `p.add_()` under `no_grad` bumps the version, `p.data = ...` moves the
    storage (what the FGM and SAM helpers in circulation do)."""
    return [(p.data_ptr(), p._version) for p in parameters]


class _ReadCounter:
    """Records reads of the presented accumulation steps (on the trainer and on a copy of its arguments)."""

    def __init__(self) -> None:
        self.reads = 0


class CountedSteps:
    """
    `current_gradient_accumulation_steps` as a trainer attribute (the Trainer's loop sets it every window) whose reads
    are counted while a bypassing override runs: an override that back-propagates by itself must divide by it (or by
    `args.gradient_accumulation_steps`) for its step to be the large batch's.
    """

    name = "_current_gradient_accumulation_steps"

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        try:
            value = trainer.__dict__[self.name]
        except KeyError:
            # Not set on this trainer yet: the class default the stock Trainer has (`Trainer`'s class attribute).
            for cls in type(trainer).__mro__:
                default = vars(cls).get("current_gradient_accumulation_steps")
                if default is not None and not isinstance(default, CountedSteps):
                    return default
            raise AttributeError("current_gradient_accumulation_steps") from None
        counter = trainer.__dict__.get("_steps_read_counter")
        if counter is not None:
            counter.reads += 1
        return value

    def __set__(self, trainer: Any, value: Any) -> None:
        trainer.__dict__[self.name] = value

    def __delete__(self, trainer: Any) -> None:
        if trainer.__dict__.pop(self.name, None) is None:
            raise AttributeError("current_gradient_accumulation_steps")


@functools.cache
def _counting_arguments_class(base: type) -> type:
    """A subclass of the arguments' class that counts reads of `gradient_accumulation_steps`."""

    class Presented(base):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            if name == "gradient_accumulation_steps":
                counter = object.__getattribute__(self, "__dict__").get("_steps_read_counter")
                if counter is not None:
                    counter.reads += 1
            return base.__getattribute__(self, name)

    Presented.__name__ = Presented.__qualname__ = base.__name__
    return Presented


def _args_presenting(args: Any, steps: float, counter: _ReadCounter) -> Any:
    """A shallow copy of `args` whose `gradient_accumulation_steps` is `steps`, counting its reads."""
    presented = object.__new__(_counting_arguments_class(type(args)))
    presented.__dict__.update(args.__dict__)
    presented.__dict__["gradient_accumulation_steps"] = steps
    presented.__dict__["_steps_read_counter"] = counter
    return presented


@contextlib.contextmanager
def counting_step_reads(trainer: Any) -> Iterator[_ReadCounter]:
    """For the context, count the reads of `trainer.args.gradient_accumulation_steps` and of
    `trainer.current_gradient_accumulation_steps` (their values unchanged)."""
    counter = _ReadCounter()
    args = trainer.args
    trainer.args = _args_presenting(args, args.gradient_accumulation_steps, counter)
    trainer.__dict__["_steps_read_counter"] = counter
    try:
        yield counter
    finally:
        trainer.args = args
        trainer.__dict__.pop("_steps_read_counter", None)


class LoopCall:
    """
    One call of the Trainer's loop: one micro-batch, however often the override calls `super().training_step`.

    `GradAccumTrainer.training_step` asks it, at each of its calls, whether the micro-batch continues (`enter`), and
    tells it what it left in `.grad` (`leave`); [`LoopCalls`] checks the call when the override returns (`check`).
    """

    def __init__(self, trainer: Any, inputs: Any, owner: str, counts: list[float] | None) -> None:
        self.trainer = trainer
        self.owner = owner
        batches = trainer._window_batches
        position = next((i for i, b in enumerate(batches) if b is inputs), None)
        # The window's items and this micro-batch's, as the settled rule counts the prefetched batches.
        self.window_items = sum(counts) if counts is not None and position is not None else None
        self.own_items = counts[position] if self.window_items is not None else None
        self.last = trainer.accelerator.sync_gradients if position is None else position == len(batches) - 1
        self.window_size = len(batches) if position is not None else None
        self.calls = 0  # of `GradAccumTrainer.training_step`
        self.inside = 0  # its depth now
        self.items: float | None = None  # the micro-batch's items, as its first call counted them
        self.ended_window = False  # the window ended inside this call (its last micro-batch)
        self.after_end: list | None = None  # `.grad`'s fingerprint when it did
        self.presented: PresentedGradients | None = None
        self.backward_outside = 0
        self.moved_between_calls = False
        self.presented_changed = False
        self.parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        self.parameters_at_start = _parameter_fingerprint(self.parameters)
        self.gradients_at_start = gradient_fingerprint(self.parameters)
        self.counter = _ReadCounter()
        # Where the window is not the accumulator's (DeepSpeed keeps the gradients, the coupled mode replays the
        # window): the override is followed only as far as one `super()` call per loop call.
        self.strict = (
            "DeepSpeed"
            if trainer._deepspeed_window is not None
            else "the coupled-loss mode"
            if trainer.coupled_mode is not None
            else None
        )
        exact = self.window_items and self.own_items and not self.strict
        self.divisor = self.window_items / self.own_items if exact else None
        self._saved: tuple[Any, ...] | None = None

    # ---------------------------------------------------------------- the divisor a bypassing override reads
    def present_divisor(self) -> None:
        """Show the override the micro-batch's exact share as the accumulation steps it divides by."""
        trainer = self.trainer
        if self.divisor is None or self._saved is not None:
            return
        self._saved = (
            trainer.args,
            trainer.__dict__.get(CountedSteps.name),
            trainer.__dict__.get("loss_is_scaled_for_ga"),
        )
        trainer.args = _args_presenting(trainer.args, self.divisor, self.counter)
        trainer.__dict__[CountedSteps.name] = self.divisor
        trainer.__dict__["_steps_read_counter"] = self.counter
        if not trainer._present_one_step:
            trainer.loss_is_scaled_for_ga = False

    def withdraw_divisor(self) -> None:
        if self._saved is None:
            return
        trainer = self.trainer
        args, steps, scaled = self._saved
        self._saved = None
        trainer.args = args
        trainer.__dict__.pop("_steps_read_counter", None)
        for name, value in ((CountedSteps.name, steps), ("loss_is_scaled_for_ga", scaled)):
            if value is None:
                trainer.__dict__.pop(name, None)
            else:
                trainer.__dict__[name] = value

    # ---------------------------------------------------------------- GradAccumTrainer.training_step's calls
    def micro_step(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """A call of `GradAccumTrainer.training_step` inside this loop call: the micro-batch, or one more loss of it;
        the window ends after it on the window's last loop call."""
        trainer = self.trainer
        self.withdraw_divisor()  # the trainer's own code reads the run's own arguments
        accumulator = trainer._get_accumulator(model)
        continues = self.enter(accumulator)
        ended = False
        try:
            loss = trainer._micro_batch_step(model, accumulator, inputs, self.items if continues else None, self.last)
            if not continues:
                self.items = trainer._micro_items
            ended = self.last and accumulator.micro_steps_in_window == 0
        finally:
            self.leave(accumulator, ended)
        return loss

    def enter(self, accumulator: Any) -> bool:
        """A call of `GradAccumTrainer.training_step` begins: put the window's own gradients back and stop what
        cannot continue. Returns whether it continues this micro-batch (a second call)."""
        self.withdraw_divisor()
        self.withdraw_presented()
        if self.calls and _parameter_fingerprint(self.parameters) != self.parameters_at_start:
            # Stopped when the override returns, after it has put its weights back.
            self.moved_between_calls = True
        if self.ended_window:
            if gradient_fingerprint(self.parameters) != self.after_end:
                self.fail(
                    "changed the window's gradient on its last micro-batch and then called "
                    "`super().training_step(...)` again, whose backward would add to the changed gradient"
                )
            try:
                accumulator.reopen_window()
            except RuntimeError as err:
                self.fail(f"called `super().training_step(...)` again after the window's gradient was final ({err})")
            self.ended_window = False
        continues = self.calls > 0
        self.calls += 1
        self.inside += 1
        return continues

    def leave(self, accumulator: Any, window_ended: bool) -> None:
        """A call of `GradAccumTrainer.training_step` returns to the override's code."""
        self.inside -= 1
        if window_ended:
            self.ended_window = True
            self.after_end = gradient_fingerprint(self.parameters)
        elif not self.last and accumulator is not None:
            total = self.window_items or (accumulator._window.items if accumulator._window else 0)
            self.presented = accumulator.present_window_so_far(total)
        self.present_divisor()

    def withdraw_presented(self) -> None:
        presented, self.presented = self.presented, None
        if presented is None:
            return
        self.presented_changed = self.presented_changed or presented.changed()
        presented.withdraw()

    def _warn_presented_changed(self) -> None:
        warned = self.trainer.__dict__.setdefault("_gradaccum_warned", set())
        if "presented_changed" not in warned:
            warned.add("presented_changed")
            logger.warning(
                "GradAccumTrainer: %s changed `.grad` after `super().training_step(...)` in the middle of a window. "
                "There `.grad` shows copies of the window's mean gradient so far, so the change does not reach the "
                "step; on the window's last micro-batch your code sees, and changes, the window's gradient, as after "
                "one large batch's backward.",
                self.owner,
            )

    def backward_handed(self, loss: torch.Tensor) -> torch.Tensor:
        """Every `accelerator.backward` of the loop call: one outside `GradAccumTrainer.training_step` is counted."""
        if not self.inside and not self.strict:  # (strict: the calls are only counted)
            self.backward_outside += 1
        return loss

    # ---------------------------------------------------------------- when the override returns
    def check(self, paths: set[str]) -> None:
        """Stop, before the optimizer steps, a call whose step cannot be the large batch's."""
        self.withdraw_divisor()
        self.withdraw_presented()  # between loop calls `.grad` is the accumulator's own again
        trainer = self.trainer
        several = (self.window_size or 2) > 1 or trainer.args.world_size > 1
        if self.strict and self.calls != 1:
            self.fail(
                f"called `super().training_step(...)` {self.calls} time(s) in one loop call; under {self.strict} "
                "GradAccumTrainer follows an override that calls it exactly once per micro-batch"
            )
        if self.moved_between_calls and several:
            self.fail(
                "changed the model's parameters between two `super().training_step(...)` calls of one micro-batch: "
                "a sharpness-aware step (SAM, ASAM) moves the weights along this micro-batch's gradient, the large "
                "batch's along the whole batch's gradient, which no accumulation has before the window's last "
                "micro-batch"
            )
        if several and _parameter_fingerprint(self.parameters) != self.parameters_at_start:
            self.fail(
                "changed the model's parameters inside a window of several micro-batches: an adversarial or "
                "sharpness-aware step (FGM, AWP, SAM) moves the weights along this micro-batch's gradient, the large "
                "batch's along the whole batch's gradient, which no accumulation has before the window's last "
                "micro-batch"
            )
        if self.calls and self.backward_outside and several:
            self.fail(
                f"called `accelerator.backward` {self.backward_outside} time(s) outside `super().training_step(...)`; "
                "GradAccumTrainer weights the losses that pass through `super().training_step` (return one loss "
                "from `compute_loss`, or call `super().training_step` with each batch)"
            )
        if self.calls:
            paths.add(ACCUMULATED)
            if self.presented_changed:
                self._warn_presented_changed()
        else:
            backward = gradient_fingerprint(self.parameters) != self.gradients_at_start
            if backward:
                paths.add(BYPASSED)
            if backward and trainer.args.world_size > 1:
                self.fail(
                    "back-propagated without `super().training_step(...)` under several processes, where "
                    "GradAccumTrainer cannot yet give it the exact divisor"
                )
            if backward and several and self.divisor is not None and not self.counter.reads:
                self.fail(
                    "back-propagated without `super().training_step(...)` and without reading the accumulation "
                    "steps to divide by (the stock Trainer would step on the sum of the micro-batches' losses)"
                )
        if paths == {ACCUMULATED, BYPASSED}:
            self.fail(
                "called `super().training_step(...)` for some micro-batches of a window and back-propagated by "
                "itself for others"
            )

    def fail(self, reason: str) -> None:
        self.abandon()
        raise OverrideStop(
            f"GradAccumTrainer stopped before the optimizer step: {self.owner} {reason}. This cannot equal one large "
            "batch's step, so the window was discarded before any optimizer step. Train this override with "
            "`gradient_accumulation_steps=1` and the largest batch that fits, or move the code into "
            "`compute_loss` (its loss is then weighted exactly). docs/trainer_fidelity.md lists which overrides stay "
            "exact."
        )

    def abandon(self) -> None:
        """Undo what this call installed and discard the window (an error or a stop inside it)."""
        self.withdraw_divisor()
        self.withdraw_presented()
        accumulator = self.trainer.accumulator
        if accumulator is not None:
            accumulator.discard_window()
        self.trainer._window_end.discard()


class LoopCalls:
    """
    The trainer's `training_step` as the Trainer's loop sees it during `train()`, for a class whose own code wraps
    `GradAccumTrainer.training_step`: each call is one [`LoopCall`].

    Example:

    ```python
    >>> trainer = MyTrainer(model=model, args=args, train_dataset=data)  # doctest: +SKIP
    >>> with LoopCalls.installed(trainer):  # doctest: +SKIP
    ...     trainer.train()  # doctest: +SKIP
    ```
    """

    def __init__(self, trainer: Any, owner: str) -> None:
        self.trainer = trainer
        self.owner = owner
        self.current: LoopCall | None = None
        self.paths: set[str] = set()
        self.window_paths: dict[str, int] = {}
        self._counted: tuple[list[Any], list[float] | None] | None = None

    @classmethod
    @contextlib.contextmanager
    def installed(cls, trainer: Any) -> Iterator[LoopCalls | None]:
        """Install the loop calls on `trainer` for the context, where a user's class wraps its `training_step`."""
        classes = user_classes_around_training_step(type(trainer))
        if not classes:
            yield None
            return
        calls = cls(trainer, f"{classes[0].__qualname__}.training_step")
        trainer._loop_calls = calls
        trainer.training_step = calls
        try:
            yield calls
        finally:
            del trainer.training_step
            trainer._loop_calls = None

    def window_counts(self) -> list[float] | None:
        """The items of each micro-batch of the window the loop prefetched, counted once per window (`None` where
        they cannot be counted before the loss)."""
        trainer = self.trainer
        batches = trainer._window_batches
        if self._counted is None or self._counted[0] is not batches:
            try:
                counts = [float(n) for n in trainer._count_window(batches)] if batches else None
            except (ValueError, TypeError, AttributeError, KeyError):
                counts = None
            self._counted = (batches, counts)
        return self._counted[1]

    def __call__(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        trainer = self.trainer
        step = type(trainer).training_step
        if self.current is not None:  # the override's own `self.training_step(...)`: part of this call
            return step(trainer, model, inputs, num_items_in_batch)
        call = LoopCall(trainer, inputs, self.owner, self.window_counts())
        self.current = call
        try:
            call.present_divisor()
            with backward_through(trainer.accelerator, call.backward_handed):
                loss = step(trainer, model, inputs, num_items_in_batch)
            call.check(self.paths)
        except OverrideStop:
            raise
        except BaseException:
            call.abandon()
            raise
        finally:
            call.withdraw_divisor()
            self.current = None
        if call.last:
            self.window_ended(call)
        return loss

    def window_ended(self, call: LoopCall) -> None:
        """The window's last loop call returned: the path it took goes into the record, and a bypassed window's
        non-finite gradient is dropped (the accumulator does so for its own windows)."""
        path = BYPASSED if BYPASSED in self.paths else ACCUMULATED if self.paths else None
        if path == BYPASSED:
            drop_non_finite(call.parameters, self.trainer.state.global_step)
        if path is not None and path not in self.window_paths:
            self.window_paths[path] = self.trainer.state.global_step
            record_training_path(self.trainer, self.owner, path)
        self.paths = set()


PATH_NOTES = {
    ACCUMULATED: "its `super().training_step(...)` calls ran through the accumulator: each loop call one micro-batch, "
    "weighted by its share of the window's items",
    BYPASSED: "it back-propagates by itself, without `super().training_step(...)`: the accumulator weighted nothing; "
    "each micro-batch's own division by the accumulation steps it reads was made its exact share of the window's "
    "items (N / n)",
}


def record_training_path(trainer: Any, owner: str, path: str) -> None:
    """Say which path a user's `training_step` took (the first window that took it): in the log, and under
    `training_step` in `output_dir/accumulation_check.json`."""
    note = PATH_NOTES[path]
    logger.info("GradAccumTrainer: %s: %s.", owner, note)
    if not trainer.is_world_process_zero():
        return
    target = os.path.join(trainer.args.output_dir, CHECK_FILE_NAME)
    record: dict[str, Any] = {}
    if os.path.isfile(target):
        with open(target) as f:
            record = json.load(f)
    paths = record.setdefault("training_step", {"override": owner, "paths": {}})
    paths["paths"][path] = {"note": note, "from_global_step": trainer.state.global_step}
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    with open(target, "w") as f:
        json.dump(record, f, indent=2)


def drop_non_finite(parameters: list[nn.Parameter], step: int) -> None:
    """A window's gradient with an inf/NaN is not applied: every `.grad` is set to `None`, so the optimizer leaves
    weights and state untouched (the stock Trainer would step on it)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        return
    for p in parameters:
        p.grad = None
    logger.warning("Skipping optimizer step %d: the window's gradient is not finite (non_finite_grad).", step + 1)
