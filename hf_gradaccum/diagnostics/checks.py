"""The self-test's single-process checks: the accumulated step against the hand-computed large batch in each
precision, and an fp16 overflow costing one micro-batch rather than the window.

Every check compares the gradient the optimizer steps with (`.grad` after the window) with a large-batch gradient
computed by hand on the same samples, and returns a [`CheckResult`] with the figure and the tolerance it was held to.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.accumulator import GradientAccumulator
from ..engine.loss_scaling import DynamicLossScaler
from ..engine.recompute import gradients_overflowed
from .precision import autocast
from .tiny_models import concatenate, tiny_model, tiny_window

FP32_RTOL = 1e-5
# bf16/fp16 are held to their own floor: the error of one low-precision pass over the whole window, both against an
# fp64 large batch. fp32 buffers keep accumulation at about that floor (measured ratios are in docs/self_test.md).
LOW_PRECISION_FLOOR_FACTOR = 2.0
FP16_SCALE = 2.0**10


@dataclass
class CheckResult:
    """One line of `hf-gradaccum test`: `status` is `"pass"`, `"fail"` or `"skip"`."""

    name: str
    status: str
    figure: str = ""
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        text = f"{self.status.upper():4}  {self.name:<30} {self.figure}"
        if self.detail:
            text += f"  [{self.detail}]"
        return text + (f"  ({self.seconds:.1f} s)" if self.seconds else "")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """`||value - reference|| / ||reference||`, in fp64."""
    value, reference = value.double().cpu(), reference.double().cpu()
    return float((value - reference).norm() / reference.norm())


def _flat_grad(model: nn.Module, scale: float = 1.0) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().flatten() / scale for p in model.parameters() if p.requires_grad])


def _loss(model: nn.Module, batch: dict, device: torch.device, precision: str) -> torch.Tensor:
    with autocast(device, precision):
        return model(**batch).loss.float()


def large_batch_gradient(
    model: nn.Module, window: list[dict], device: torch.device, precision: str = "fp32", scale: float = 1.0
) -> torch.Tensor:
    """The gradient of the model's own mean loss over the window's micro-batches taken as one batch (by hand)."""
    model.zero_grad(set_to_none=True)
    (_loss(model, concatenate(window), device, precision) * scale).backward()
    return _flat_grad(model, scale)


def accumulated_gradient(
    model: nn.Module, window: list[dict], device: torch.device, precision: str, scaler: DynamicLossScaler | None = None
) -> tuple[torch.Tensor, GradientAccumulator, list[int]]:
    """The gradient `GradientAccumulator` hands the optimizer after the window, each micro-batch weighted by the
    items its loss averages over (`batch=`); with a `scaler`, through the fp16 recompute path. Also returns the
    accumulator and how many forward passes each micro-batch took."""
    model.zero_grad(set_to_none=True)
    accumulator = GradientAccumulator(model, len(window), loss_scaler=scaler)
    forwards = [0] * len(window)
    try:
        for k, batch in enumerate(window):

            def compute_loss(k: int = k, batch: dict = batch) -> torch.Tensor:
                forwards[k] += 1
                return _loss(model, batch, device, precision)

            if scaler is None:
                accumulator.backward(compute_loss(), batch=batch)
            else:
                accumulator.accumulate_micro_batch(compute_loss, batch=batch)
        result = accumulator.finish_window()
    finally:
        accumulator.remove_hooks()
    if not result.applied:
        raise AssertionError(f"the window was not applied (skipped: {result.skip_reason})")
    return _flat_grad(model), accumulator, forwards


def _low_precision_copy(model: nn.Module, precision: str) -> nn.Module:
    # bf16: bf16 parameters (where fp32 buffers matter most); fp16: fp32 parameters under autocast, as `fp16=True`.
    return copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else copy.deepcopy(model)


def check_parity(kind: str, precision: str, device: torch.device) -> CheckResult:
    """The accumulated step of `kind`'s tiny model on uneven micro-batches against the hand-computed large batch."""
    name = f"parity/{kind}/{precision}"
    model = tiny_model(kind).to(device)
    window = tiny_window(kind, device)
    if precision == "fp32":
        reference = large_batch_gradient(copy.deepcopy(model), window, device)
        ours, _, _ = accumulated_gradient(copy.deepcopy(model), window, device, "fp32")
        error = relative_error(ours, reference)
        return _verdict(name, error, FP32_RTOL, "rel. error vs large batch")
    reference = large_batch_gradient(copy.deepcopy(model).double(), window, device)
    scale = FP16_SCALE if precision == "fp16" else 1.0
    one_pass = large_batch_gradient(_low_precision_copy(model, precision), window, device, precision, scale)
    scaler = DynamicLossScaler(init_scale=scale, growth_interval=10**6) if precision == "fp16" else None
    ours, _, _ = accumulated_gradient(_low_precision_copy(model, precision), window, device, precision, scaler)
    floor = relative_error(one_pass, reference)
    error = relative_error(ours, reference)
    tolerance = LOW_PRECISION_FLOOR_FACTOR * floor
    return _verdict(name, error, tolerance, "rel. error vs fp64 large batch",
                    f"one {precision} pass: {floor:.2e}; tolerance {LOW_PRECISION_FLOOR_FACTOR:g}x that")  # fmt: skip


def _verdict(name: str, error: float, tolerance: float, what: str, detail: str = "") -> CheckResult:
    status = "pass" if error <= tolerance else "fail"
    return CheckResult(name, status, f"{what} {error:.2e} <= {tolerance:.1e}" if status == "pass"
                       else f"{what} {error:.2e} > {tolerance:.1e}", detail)  # fmt: skip


def _overflows(model: nn.Module, batch: dict, device: torch.device, scale: float) -> bool:
    model.zero_grad(set_to_none=True)
    (_loss(model, batch, device, "fp16") * scale).backward()
    overflowed = gradients_overflowed([p for p in model.parameters() if p.requires_grad])
    model.zero_grad(set_to_none=True)
    return overflowed


def separating_scale(model: nn.Module, window: list[dict], device: torch.device, index: int) -> float | None:
    """The smallest power-of-two loss scale at which micro-batch `index` overflows in fp16 while the others do not
    (so an overflow can be placed in the middle of a window), or `None` if no such scale exists."""
    for exponent in range(1, 100):
        scale = 2.0**exponent
        if _overflows(model, window[index], device, scale):
            others = [k for k in range(len(window)) if k != index]
            if any(_overflows(model, window[k], device, scale) for k in others):
                return None
            return scale
    return None


def check_fp16_overflow(device: torch.device) -> CheckResult:
    """An fp16 overflow in the window's middle micro-batch: only that micro-batch is redone (at half the scale), the
    window is applied, and its gradient equals the window run at that scale from the start."""
    name = "fp16-overflow/one-micro-batch"
    model = tiny_model("causal-lm").to(device)
    window = tiny_window("causal-lm", device)
    scale = separating_scale(copy.deepcopy(model), window, device, index=1)
    if scale is None:
        return CheckResult(name, "skip", detail="no loss scale overflows the middle micro-batch alone on this device")
    clean, _, _ = accumulated_gradient(copy.deepcopy(model), window, device, "fp16",
                                       DynamicLossScaler(init_scale=scale / 2, growth_interval=10**6))  # fmt: skip
    try:
        ours, accumulator, forwards = accumulated_gradient(
            copy.deepcopy(model), window, device, "fp16", DynamicLossScaler(init_scale=scale, growth_interval=10**6)
        )
    except AssertionError as error:
        return CheckResult(name, "fail", "forward passes per micro-batch: not recorded", str(error))
    expected = [1, 2, 1]
    error = relative_error(ours, clean)
    ok = forwards == expected and accumulator.recomputed_micro_batches == 1 and error <= 1e-3
    figure = (f"forward passes per micro-batch {forwards} (expected {expected}), "
              f"rel. difference vs clean window {error:.1e} <= 1e-03")  # fmt: skip
    return CheckResult(
        name, "pass" if ok else "fail", figure, f"overflow at loss scale 2^{int(scale).bit_length() - 1}"
    )


SINGLE_PROCESS_CHECKS: dict[str, Callable[..., CheckResult]] = {
    "parity": check_parity,
    "fp16-overflow": check_fp16_overflow,
}
