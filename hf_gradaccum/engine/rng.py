"""Every random-number generator a forward pass may draw from, captured and restored as one state: torch CPU, torch
CUDA (all devices, if CUDA is initialised), numpy's global generator and Python's `random`.

A second forward of the same micro-batch must draw the same random values as the first (gradient caching's replay,
the MoE window's forward-only counting pass), and a probe must leave the generators as it found them (the
split-invariance check), so all of these restore the whole state, not only torch's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

try:  # numpy is optional; its global generator is saved when it is there
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = ["RNGState", "capture_rng_state", "generators_advanced_since", "restore_rng_state"]


@dataclass
class RNGState:
    """The state of every generator named in the module docstring (`None` for those that are not there)."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None
    numpy: Any
    python: Any


def capture_rng_state() -> RNGState:
    """The current state of every generator of [`RNGState`]."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return RNGState(torch.get_rng_state(), cuda, np.random.get_state() if np is not None else None, random.getstate())


def restore_rng_state(state: RNGState) -> None:
    """Put every generator back to `state` (from [`capture_rng_state`])."""
    torch.set_rng_state(state.torch_cpu)
    if state.torch_cuda is not None:
        torch.cuda.set_rng_state_all(state.torch_cuda)
    if state.numpy is not None:
        np.random.set_state(state.numpy)
    random.setstate(state.python)


def generators_advanced_since(state: RNGState) -> list[str]:
    """The generators whose state moved since `state` was captured (what a forward drew from)."""
    now = capture_rng_state()
    moved = []
    if not torch.equal(now.torch_cpu, state.torch_cpu):
        moved.append("torch CPU RNG")
    if state.torch_cuda is not None and now.torch_cuda is not None:
        if any(not torch.equal(a, b) for a, b in zip(now.torch_cuda, state.torch_cuda, strict=False)):
            moved.append("torch CUDA RNG")
    if state.numpy is not None and not _numpy_states_equal(now.numpy, state.numpy):
        moved.append("numpy global RNG (np.random)")
    if now.python != state.python:
        moved.append("Python `random`")
    return moved


def _numpy_states_equal(a: Any, b: Any) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])
