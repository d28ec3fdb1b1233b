"""Window bookkeeping: what one accumulation window has seen so far, and the `WindowResult` it ends with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class WindowResult:
    """What happened at the end of one accumulation window."""

    applied: bool
    """Whether the accumulated gradient was written to `.grad` (the optimizer should step)."""
    num_items: float
    """Items in the window, summed over micro-batches and ranks."""
    loss: float | None
    """Item-weighted mean loss of the window (the large-batch loss); `None` if the window had no items."""
    micro_steps: int
    """Micro-batches in the window (a partial last window has fewer than `gradient_accumulation_steps`)."""
    skip_reason: str | None = None
    """`None`, `"no_items"`, `"non_finite_loss"`, `"non_finite_grad"` or `"overflow"`."""
    recomputed_micro_batches: int = 0
    """Micro-batches of this window recomputed after an fp16 overflow."""
    grad_norm: float | None = None
    """The applied mean gradient's norm before clipping, when the window was finished with `max_grad_norm`
    ([`GradientAccumulator.step`] with clipping, or the Trainer's clipping)."""


@dataclass
class WindowState:
    """The running totals of the current window on this rank."""

    num_parameters: int
    device: torch.device
    micro_steps: int = 0
    items: float = 0.0
    recomputed: int = 0
    overflowed: bool = False
    backoffs: int = 0
    loss_sum: torch.Tensor = field(init=False)
    """`sum_k n_k * loss_k` in float64, kept on the device: summing it costs no host synchronisation."""
    touched: list[bool] = field(init=False)
    """Which parameters got a gradient in this window (the others keep `.grad = None`, as with one large batch)."""

    def __post_init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.touched = [False] * self.num_parameters

    def record_loss(self, loss: torch.Tensor, num_items: float) -> None:
        if num_items == 0:
            return  # a mean over no items is 0/0 (NaN) and weighs nothing
        self.loss_sum += loss.detach().to(torch.float64) * num_items

    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_steps": self.micro_steps,
            "items": self.items,
            "recomputed": self.recomputed,
            "overflowed": self.overflowed,
            "backoffs": self.backoffs,
            "loss_sum": self.loss_sum.detach().cpu(),
            "touched": list(self.touched),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_steps, self.items, self.recomputed = state["micro_steps"], state["items"], state["recomputed"]
        self.overflowed, self.touched = state["overflowed"], list(state["touched"])
        self.backoffs = state.get("backoffs", 0)
        self.loss_sum.copy_(state["loss_sum"])
