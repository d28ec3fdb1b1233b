"""DDP: all-reduce the flat buffer in buckets during the window's last backward, as DDP overlaps its own reduction.

Without overlap the whole buffer is all-reduced after the last micro-batch's backward has finished, so the
communication adds to the step time. Here, during the *last* micro-batch of a full window, each parameter's slice of
the buffer is final as soon as its gradient has been folded; the buffer is cut into buckets (about 25 MB, like DDP's
`bucket_cap_mb`, the first one 1 MB so communication starts early) in reverse registration order, which is roughly
the order in which backward produces the gradients, and a bucket is all-reduced asynchronously (`async_op=True`) as
soon as all of its parameters are folded. The window end only launches what is left and waits.

Rules that keep every rank's collectives paired (gloo and NCCL match collectives by their order in a group):

* Every window launches exactly the same buckets, in the same order (bucket `i` only after buckets `< i`), on
  every rank. A bucket whose parameters were not all folded in the last micro-batch on this rank (a parameter unused
  here, used on another rank; one that got gradients only in earlier micro-batches; a rank whose loss was non-finite
  so its backward did not run; a partial window at the end of an epoch) is launched at the window end, in order.
  Ranks that disagree on whether a window is full therefore still agree on the collectives.
* The buckets travel on a process group of their own, created once per accumulator (a collective call: construct
  the accumulator on every rank). A rank may launch a bucket during its backward while another rank launches the
  same bucket only at the window end; on a shared group, any collective in between (a user's `gather` of the loss
  between the last backward and `step()`, SyncBatchNorm's backward) would pair with a bucket and corrupt both.
* A buffer slice is never written while its all-reduce may be in flight: a second gradient for an already-launched
  parameter, another micro-batch after the last one, a checkpoint or an abandoned window after a launch all raise,
  because the other ranks have already summed this rank's data (see [`OverlappedReduction.abandon_window`]).

Results equal the window-end reduction: an all-reduce of 2 ranks sums each element once in either case (bitwise);
with more ranks the summation order inside the collective may differ by rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .buffers import FlatGradientBuffers

DEFAULT_BUCKET_CAP_MB = 25.0
"""Like DDP's `bucket_cap_mb`."""
FIRST_BUCKET_CAP_MB = 1.0
"""Like DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): a small one, so communication starts
while most of the backward is still to come."""


def validate_bucket_cap_mb(value: Any) -> float:
    """Return `value` as a float if it is a finite number > 0; otherwise raise a `ValueError` naming `bucket_cap_mb`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`bucket_cap_mb` must be a finite number of megabytes > 0, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class Bucket:
    """A contiguous slice `[start, end)` of the flat buffer on `device`, holding the parameters `params`."""

    device: torch.device
    start: int
    end: int
    params: tuple[int, ...]


def assign_buckets(
    buffers: FlatGradientBuffers, bucket_cap_mb: float, first_bucket_cap_mb: float = FIRST_BUCKET_CAP_MB
) -> list[Bucket]:
    """
    Cut the flat buffers into buckets in reverse registration order, as DDP does: parameters are added to a bucket
    until it holds at least the cap (so one tensor larger than the cap is a bucket of its own). The first bucket of
    each device is capped at `min(first_bucket_cap_mb, bucket_cap_mb)`. The buffer is laid out in registration order,
    so every bucket is one contiguous slice.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.buffers import FlatGradientBuffers
    >>> from hf_gradaccum.engine.overlap import assign_buckets
    >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    >>> buckets = assign_buckets(FlatGradientBuffers(list(model.parameters()), torch.float32), bucket_cap_mb=25)
    >>> [b.params for b in buckets]  # 1 MB first bucket: the last layer's weight (1 MiB) and bias
    [(3, 2), (1, 0)]
    ```
    """
    element_size = buffers.dtype.itemsize
    open_buckets: dict[torch.device, list[int]] = {}
    open_bytes: dict[torch.device, int] = {}
    closed_any: set[torch.device] = set()
    groups: list[tuple[torch.device, list[int]]] = []
    for index in reversed(range(len(buffers.views))):
        view = buffers.views[index]
        device = view.device
        open_buckets.setdefault(device, []).append(index)
        open_bytes[device] = open_bytes.get(device, 0) + view.numel() * element_size
        cap_mb = bucket_cap_mb if device in closed_any else min(first_bucket_cap_mb, bucket_cap_mb)
        if open_bytes[device] >= cap_mb * 1024 * 1024:
            groups.append((device, open_buckets.pop(device)))
            open_bytes[device] = 0
            closed_any.add(device)
    groups.extend(open_buckets.items())  # what is left of each device, in device order
    buckets = []
    for device, params in groups:
        starts = [buffers.views[i].storage_offset() for i in params]
        end = max(s + buffers.views[i].numel() for s, i in zip(starts, params, strict=True))
        buckets.append(Bucket(device, min(starts), end, tuple(params)))
    return buckets


class OverlappedReduction:
    """
    Launches the all-reduce of each bucket of `buffers` as soon as its gradients are final during a window's last
    micro-batch, and the rest at the window end. The accumulator calls [`begin_micro_batch`] for every micro-batch,
    [`folded`] after every fold, [`launch_remaining`] + [`wait`] at the window end, and [`abandon_window`] before
    throwing a window away.

    Args:
        buffers ([`FlatGradientBuffers`]): the replicated (DDP) accumulation buffers.
        group: the process group the buckets are all-reduced on (one reserved for them; see the module docstring).
        bucket_cap_mb (`float`): bucket size in megabytes of the buffer's dtype.

    Example (under a multi-process launch; tests/workers/overlap_ddp.py runs this on 2 gloo processes):

    ```python
    >>> accumulator = GradientAccumulator(ddp_model, 4, bucket_cap_mb=25)  # doctest: +SKIP
    >>> for i, batch in enumerate(batches):  # doctest: +SKIP
    ...     with accumulator.accumulate(ddp_model):  # no_sync: DDP's own reducer stays idle
    ...         accumulator.backward(ddp_model(**batch).loss, num_items=len(batch["labels"]))
    ...     if accumulator.sync_gradients:  # the 4th backward launched the buckets; step() waits for them
    ...         accumulator.step(optimizer)
    ```
    """

    def __init__(self, buffers: FlatGradientBuffers, group: Any, bucket_cap_mb: float) -> None:
        self.buffers = buffers
        self.group = group
        self.buckets = assign_buckets(buffers, bucket_cap_mb)
        self.bucket_of = [0] * len(buffers.views)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self.bucket_of[i] = b
        self._armed = False
        self._marked: list[bool] = []
        self._pending: list[int] = []
        self._launched = 0
        self._works: list[Any] = []
        self.launched_during_backward = 0
        """Buckets of the last window launched before its end (for tests and benchmarks)."""

    @classmethod
    def for_accumulator(
        cls, buffers: FlatGradientBuffers, reduce_gradients: bool | None, enabled: bool | None, bucket_cap_mb: float
    ) -> OverlappedReduction | None:
        """The overlapped reduction for replicated buffers reduced over more than one rank, or `None` (no overlap:
        disabled, one process, or no process group yet, in which case the window end
        reduces the whole buffer). `enabled=None` means on for accelerator buffers, off for CPU ones."""
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        if reduce_gradients is False or not buffers.reduced_at_window_end:
            return None  # FSDP2's sharded buffers are reduce-scattered by FSDP2 itself: no all-reduce to overlap
        if enabled is None:
            enabled = buffers.first_device.type != "cpu"
        if not enabled or not initialized or dist.get_world_size() <= 1:
            return None
        # A group of our own for the buckets (why: module docstring). `new_group` must run on every rank in the same
        # order, which constructing the accumulator on every rank does.
        return cls(buffers, torch.distributed.new_group(), bucket_cap_mb)

    # ------------------------------------------------------------------ during the window
    def begin_micro_batch(self, last: bool) -> None:
        """Called as each micro-batch begins; `last` when it completes a full window."""
        if self._launched:
            self._fail(
                "a micro-batch was started after the window's last one (`gradient_accumulation_steps` micro-batches) "
                "had already launched its gradient all-reduce; call `step()`/`finish_window()` after exactly "
                "`gradient_accumulation_steps` micro-batches"
            )
        self._armed = last
        if last:
            self.launched_during_backward = 0
            self._marked = [False] * len(self.bucket_of)
            self._pending = [len(b.params) for b in self.buckets]

    def folded(self, index: int) -> None:
        """Parameter `index`'s gradient was folded into the buffer: launch every bucket that is now complete."""
        if not self._armed:
            return
        if self._marked[index]:
            if self.bucket_of[index] < self._launched:
                self._fail(
                    f"parameter {index} got a second gradient in the last micro-batch after its bucket's all-reduce "
                    "had started (a parameter shared between reentrant activation-checkpointing segments?)"
                )
            return
        self._marked[index] = True
        self._pending[self.bucket_of[index]] -= 1
        while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
            self._launch_next()
        self.launched_during_backward = self._launched

    def ensure_idle(self, action: str) -> None:
        """Raise if a bucket of the current window is already reduced or in flight (the buffer is no longer this
        rank's own sum, so `action` cannot use it)."""
        if self._launched:
            self._fail(f"{action} was called after the window's last micro-batch had launched its all-reduce")

    def abandon_window(self) -> None:
        """
        The current window is thrown away (OOM retry, a loaded checkpoint). Nothing launched: nothing to undo. Once a
        bucket is launched the other ranks have already summed this rank's data and expect the rest of this window's
        buckets, so no retry can be exact: this raises (after waiting, so no buffer is zeroed under a collective).
        `GradAccumTrainer` with `auto_find_batch_size` turns overlap off for this reason.
        """
        if self._launched:
            self._fail("the window was discarded (e.g. an out-of-memory retry) after its all-reduce had started")
        self._armed = False

    # ------------------------------------------------------------------ window end
    def launch_remaining(self) -> int:
        """Launch every bucket not launched yet, in order. Returns the number of buckets (collectives) per window."""
        if not self._armed:
            self.launched_during_backward = 0
        while self._launched < len(self.buckets):
            self._launch_next()
        return len(self.buckets)

    def wait(self) -> None:
        """Wait for every launched bucket, then get ready for the next window."""
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self._launched = 0
        self._armed = False

    def _launch_next(self) -> None:
        bucket = self.buckets[self._launched]
        flat = self.buffers.flat[bucket.device]
        self._works.append(
            torch.distributed.all_reduce(flat[bucket.start : bucket.end], group=self.group, async_op=True)
        )
        self._launched += 1

    def _fail(self, what: str) -> None:
        self.wait()  # never leave a collective writing into a buffer that is about to be reused
        raise RuntimeError(
            f"GradientAccumulator (overlapped DDP reduction): {what}. The other ranks have already summed this "
            "rank's buffer, so the window cannot be made exact. Construct the accumulator with "
            "`overlap_reduction=False` to reduce only at the window end."
        )
