"""Keep the Trainer's counters honest when an accumulation window is skipped (no items, NaN/inf, fp16 overflow).

The stock loop advances `global_step` and the learning-rate scheduler after every window. For a skipped window the
accumulator leaves every `.grad` at `None` (so `optimizer.step()` changes neither weights nor optimizer state); these
two small pieces make the scheduler and `global_step` skip it as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback


class SkipAwareLRScheduler:
    """
    Wraps a learning-rate scheduler so that `step()` does nothing after a skipped window; everything else (state
    dicts, `get_last_lr`, attributes) passes through, so checkpoints are unchanged.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.adapters.step_gating import SkipAwareLRScheduler
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    >>> applied = [False]
    >>> sched = SkipAwareLRScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), lambda: applied[0])
    >>> sched.step(); sched.get_last_lr()
    [1.0]
    ```
    """

    def __init__(self, scheduler: Any, last_window_applied: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self._last_window_applied = last_window_applied

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._last_window_applied():
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class SkippedStepCallback(TrainerCallback):
    """
    Runs last in `on_step_end`: after a skipped window it takes back the `global_step` increment (and the checkpoint
    or evaluation that the increment may have triggered), so `global_step` counts applied optimizer steps only.
    """

    def __init__(self, last_window_applied: Callable[[], bool]) -> None:
        self._last_window_applied = last_window_applied

    def on_step_end(self, args, state, control, **kwargs):
        if self._last_window_applied():
            return control
        reached_max_now = state.global_step >= state.max_steps > state.global_step - 1
        state.global_step -= 1
        control.should_save = False
        control.should_evaluate = False
        if reached_max_now and control.should_training_stop:
            control.should_training_stop = False
        return control
