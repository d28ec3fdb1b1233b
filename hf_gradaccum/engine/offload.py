"""The accumulation buffer in host memory: the GPU holds about one parameter's gradient at a time.

With bf16 parameters an fp32 accumulation buffer on the GPU costs 4 bytes per parameter where a stock bf16 `.grad`
costs 2: the wrong direction for a small GPU. [`OffloadedGradientBuffers`] keeps the buffer in pinned host memory
instead, as FSDP's `CPUOffload` and ZeRO-Offload keep gradients (seed 004):

- as soon as autograd produces a parameter's gradient, the fold hook copies it into one of a few pinned staging
  slots on a side CUDA stream (so the copy overlaps the rest of the backward) and frees the GPU gradient;
- a single host thread waits for that copy and adds it, item-weighted, into the fp32 host buffer. torch's CPU kernels
  release the GIL, so the backward keeps launching kernels while the host adds;
- a slot is reused only after its add finished, so at most `num_slots` gradients are in flight;
- at the window's end the mean gradient returns to the GPU in the parameter's dtype for clipping and the step (the
  optimizer stays on the GPU: stepping on the host would need host copies of the weights and optimizer state).

The host buffer is summed over ranks where the process group can reduce host memory (gloo); under NCCL, which cannot,
it travels through the GPU one chunk at a time, so the GPU never holds more than one chunk of it.

The same code runs with the parameters on the CPU (the host is then also the "device"): the copy is a plain add,
which is how the offload path's exactness is tested without a GPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .buffers import FlatGradientBuffers

ALL_REDUCE_CHUNK_NUMEL = 1 << 24
"""Elements of the host buffer sent through the GPU at once when the process group cannot reduce host memory (64 MiB
in fp32)."""


def group_reduces_host_memory(group: Any = None) -> bool:
    """Whether `torch.distributed`'s (default) process group has a backend for CPU tensors (gloo, or a
    `cpu:gloo,cuda:nccl` group); NCCL alone has none."""
    dist = torch.distributed
    group = group or dist.distributed_c10d._get_default_group()
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return False
    return True


class _HostFolder:
    """One background thread that folds staged gradients into the host buffer, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hf_gradaccum-offload-fold", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # `stop`
                self._jobs.task_done()
                return
            try:
                job()  # every job runs, even after an error: each one frees its staging slot
            except BaseException as error:  # noqa: BLE001 - re-raised on the training thread by `wait`
                self._error = self._error or error
            finally:
                self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """End the thread once the folds submitted so far are done."""
        self._jobs.put(None)

    def wait(self) -> None:
        """Block until every submitted fold is done; re-raise the first error one of them hit."""
        self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("Folding an offloaded gradient into the host buffer failed.") from error


class _StagingSlot:
    """A (pinned) host area as large as the largest gradient; `free` is set once its last fold is done."""

    def __init__(self, num_bytes: int, pinned: bool) -> None:
        self.storage = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.free = threading.Event()
        self.free.set()

    def view(self, like: torch.Tensor) -> torch.Tensor:
        return self.storage[: like.numel() * like.element_size()].view(like.dtype)


class OffloadedGradientBuffers(FlatGradientBuffers):
    """
    [`FlatGradientBuffers`] whose flat buffers live in host memory (pinned when the parameters are on CUDA); see the
    module docstring.

    Args:
        parameters (`Sequence[nn.Parameter]`): the trainable parameters, on CUDA or on the CPU.
        dtype (`torch.dtype`): the buffer's dtype (fp32 by default in [`GradientAccumulator`]).
        num_slots (`int`, *optional*, defaults to 2): staging slots, i.e. gradients in flight to the host buffer.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.offload import OffloadedGradientBuffers
    >>> model = torch.nn.Linear(3, 2)
    >>> buffers = OffloadedGradientBuffers(list(model.parameters()), torch.float32)
    >>> buffers.flat[torch.device("cpu")].device.type, [tuple(v.shape) for v in buffers.views]
    ('cpu', [(2, 3), (2,)])
    ```
    """

    def __init__(self, parameters: Sequence[nn.Parameter], dtype: torch.dtype, num_slots: int = 2) -> None:
        self.devices: list[torch.device] = list(dict.fromkeys(p.device for p in parameters))
        unsupported = sorted({str(d) for d in self.devices if d.type not in ("cuda", "cpu")})
        if unsupported:
            raise ValueError(
                "`offload_accumulation_buffer=True` supports parameters on CUDA devices and the CPU; got parameters "
                f"on {unsupported}."
            )
        self.pinned = any(d.type == "cuda" for d in self.devices)
        super().__init__(parameters, dtype)
        self._param_devices = [p.device for p in parameters]
        largest = max(p.numel() * p.element_size() for p in parameters)
        self._slots = [_StagingSlot(largest, self.pinned) for _ in range(num_slots)]
        self._next_slot = 0
        self._streams = {d: torch.cuda.Stream(device=d) for d in self.devices if d.type == "cuda"}
        self._folder = _HostFolder()
        self._returned: torch.cuda.Event | None = None
        self.reduce_on_host: bool | None = None
        """Sum over ranks on the host (`True`), through the device in chunks (`False`), or as the process group
        allows (`None`: on the host where it has a CPU backend)."""
        self.all_reduce_chunk_numel = ALL_REDUCE_CHUNK_NUMEL

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Keyed by the parameters' device like the base class's buffers (one flat buffer and its views per device),
        # but each of them lives on the host.
        return torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")

    @property
    def first_device(self) -> torch.device:
        """The parameters' (first) device: the window's statistics are reduced there, as the backend needs."""
        return self.devices[0]

    # ------------------------------------------------------------------ the fold
    def fold(self, index: int, grad: torch.Tensor, alpha: float) -> None:
        """Stage `grad` in the next free slot and queue `views[index] += alpha * grad` on the host thread."""
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        slot.free.wait()  # the slot's previous gradient is in the buffer: it may be overwritten
        slot.free.clear()
        staged, view = slot.view(grad), self.views[index]
        copied = None
        if grad.device.type == "cuda":
            stream = self._streams[grad.device]
            # The gradient was produced on the backward's current stream: the copy waits for it, and the caching
            # allocator must not hand its memory out again before the copy stream has read it.
            stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(stream):
                staged.copy_(grad.reshape(-1), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            grad.record_stream(stream)
        else:
            staged.copy_(grad.reshape(-1))

        def fold_staged() -> None:
            try:
                if copied is not None:
                    copied.synchronize()
                # Only the host thread adds into the buffer, so the one widening scratch serves every fold.
                self._add(view, staged.view_as(view), alpha)
            finally:
                slot.free.set()

        self._folder.submit(fold_staged)

    def synchronize(self) -> None:
        """Wait until every gradient handed to [`fold`] is in the host buffer."""
        self._folder.wait()

    def close(self) -> None:
        """Stop the host thread (the accumulator's `remove_hooks`: no gradient will arrive any more)."""
        self._folder.stop()

    # ------------------------------------------------------------------ what reads or writes the whole buffer
    def zero_(self) -> None:
        self.synchronize()
        if self._returned is not None:  # the previous window's gradients may still be copying back from it
            self._returned.synchronize()
            self._returned = None
        super().zero_()

    def scale_(self, factor: float) -> None:
        self.synchronize()
        super().scale_(factor)

    def all_finite(self) -> bool:
        self.synchronize()
        return super().all_finite()

    def all_reduce_(self, group: torch.distributed.ProcessGroup | None = None) -> int:
        """Sum the host buffers over `group`'s ranks (every rank's when `None`): directly where the group reduces host
        memory (gloo), else through the GPU in chunks of [`ALL_REDUCE_CHUNK_NUMEL`] elements. Returns the number of
        collectives."""
        self.synchronize()
        on_host = self.reduce_on_host if self.reduce_on_host is not None else group_reduces_host_memory()
        if on_host:
            return super().all_reduce_(group)
        collectives = 0
        for device, buffer in self.flat.items():
            step = self.all_reduce_chunk_numel
            for start in range(0, buffer.numel(), step):
                host = buffer[start : start + step]
                chunk = host.to(device, non_blocking=True)
                torch.distributed.all_reduce(chunk, group=group)
                host.copy_(chunk)
                collectives += 1
        return collectives

    def gradient_for(self, index: int, param_dtype: torch.dtype) -> torch.Tensor:
        """The mean gradient on the parameter's device, in its dtype (a view of the buffer on the CPU)."""
        view, device = self.views[index], self._param_devices[index]
        if device.type == "cpu":
            return super().gradient_for(index, param_dtype)
        grad = view.to(device=device, dtype=param_dtype, non_blocking=True)
        # Stream order: the event after the last copy covers every earlier one.
        self._returned = torch.cuda.Event()
        self._returned.record(torch.cuda.current_stream(device))
        return grad

    def snapshot(self) -> list[torch.Tensor]:
        self.synchronize()
        return super().snapshot()

    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        self.synchronize()
        super().restore(saved)
