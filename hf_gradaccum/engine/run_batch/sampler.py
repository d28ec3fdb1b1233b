"""[`RunBatchSampler`]: the micro-batches of a run's batch, for any number of processes, resumable on any layout.

The epoch's order depends on the dataset length, the seed and the epoch alone: the rows in order, or the permutation
`torch.randperm(n)` drawn from `seed + epoch` (the one the stock Trainer draws through Accelerate's seedable sampler on
one process). Windows are consecutive slices of `effective_batch_size` rows of it; [`RunBatchLayout`] lays each out over
the ranks. So the same windows come out for any `world_size` and `micro_batch_size`, and a position counted in windows
means the same samples on every layout.

With `rank=None` the sampler yields every rank's micro-batches of a window interleaved (rank 0's first, rank 1's
first, ..., rank 0's second, ...), which is exactly how Accelerate's `prepare` deals a batch sampler's batches out to
the processes: the Trainer and `accelerator.prepare(DataLoader(ds, batch_sampler=sampler))` loops use it so. With
`rank=r` it yields that rank's micro-batches only, for loops that build their per-rank loader themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..validation import check_positive_int
from .layout import RunBatchLayout, window_rows

STATE_KEYS = ("dataset_length", "effective_batch_size", "shuffle", "seed", "drop_last")


class RunBatchSampler(Sampler[list[int]]):
    """
    A batch sampler whose windows are the run's: rows `[wB, (w+1)B)` of the epoch's order, split over `world_size`
    ranks (shares differ by at most one row) into the same number of micro-batches of at most `micro_batch_size` rows
    on every rank. Pair it with a [`GradientAccumulator`] built with the same `effective_batch_size` and
    `micro_batch_size`; call the accumulator's `flush` at the end of each epoch (its last window may be shorter).

    Args:
        dataset_length (`int`): rows in the dataset.
        effective_batch_size (`int`): rows per window (per optimizer step), over all ranks.
        micro_batch_size (`int`): largest micro-batch a rank runs.
        world_size (`int`, *optional*, defaults to 1): data-parallel processes.
        rank (`int`, *optional*): yield this rank's micro-batches only; `None` (default) yields every rank's,
            interleaved, for Accelerate's `prepare` to deal out.
        shuffle (`bool`, *optional*, defaults to `True`): a permutation drawn from `seed + epoch`; `False`: in order.
        seed (`int`, *optional*, defaults to 0): the permutation's seed.
        drop_last (`bool`, *optional*, defaults to `False`): drop the epoch's last, shorter window.

    Example:

    ```python
    >>> from hf_gradaccum import RunBatchSampler
    >>> sampler = RunBatchSampler(20, effective_batch_size=10, micro_batch_size=2, world_size=3, rank=2, shuffle=False)
    >>> list(sampler)  # rank 2's share of each window: rows 7-9, then 17-19
    [[7, 8], [9], [17, 18], [19]]
    ```
    """

    def __init__(
        self,
        dataset_length: int,
        effective_batch_size: int,
        micro_batch_size: int,
        *,
        world_size: int = 1,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        check_positive_int(dataset_length, "dataset_length")
        self.layout = RunBatchLayout(effective_batch_size, micro_batch_size, world_size)
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"`rank` must be None or an integer in [0, {world_size}), got {rank!r}.")
        self.dataset_length = dataset_length
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        # Accelerate's `BatchSamplerShard` reads `batch_size`: `None` tells it the batches vary in size.
        self.batch_size = None
        self.windows = window_rows(dataset_length, effective_batch_size, drop_last)
        if not self.windows:
            raise ValueError(
                f"`effective_batch_size={effective_batch_size}` is larger than the dataset ({dataset_length} rows) "
                "and the last window is dropped (`drop_last`/`dataloader_drop_last`): an epoch would have no window."
            )
        reason = self.layout.why_not(self.windows[-1])
        if reason is not None:
            raise ValueError(
                f"The epoch's last window (dataset of {dataset_length} rows, `effective_batch_size="
                f"{effective_batch_size}`): {reason} Or drop it with `dataloader_drop_last=True`."
            )
        self.epoch = 0
        # Where the next iteration starts, once (a resume): (window, micro-batch within it).
        self._start: tuple[int, int] = (0, 0)

    @property
    def effective_batch_size(self) -> int:
        """Rows per window, over all ranks."""
        return self.layout.effective_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per rank in a full window."""
        return self.layout.gradient_accumulation_steps

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration follows (the permutation is drawn from `seed + epoch`)."""
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> list[int]:
        """The epoch's order of the dataset's rows."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.dataset_length))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_length, generator=generator).tolist()

    def _ranks(self) -> list[int]:
        return list(range(self.layout.world_size)) if self.rank is None else [self.rank]

    def __len__(self) -> int:
        per_rank = sum(self.layout.micro_batches(rows) for rows in self.windows)
        return per_rank * len(self._ranks())

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        (start_window, start_micro), self._start = self._start, (0, 0)
        ranks = self._ranks()
        for w, rows in enumerate(self.windows):
            if w < start_window:
                continue
            first = w * self.layout.effective_batch_size
            per_rank = [self.layout.rank_micro_batches(rows, r) for r in ranks]
            for k in range(self.layout.micro_batches(rows)):
                if w == start_window and k < start_micro:
                    continue
                for batches in per_rank:
                    yield [order[first + i] for i in batches[k]]

    # ------------------------------------------------------------------ resume
    def state_dict(self, windows_done: int, micro_batches_done: int = 0) -> dict[str, Any]:
        """
        The run's position after `windows_done` windows since the run began (all epochs) and `micro_batches_done`
        micro-batches of the next one, with what defines the run's windows and the layout it was on.
        `samples` counts the rows of the run consumed by finished windows.
        """
        epoch, window = divmod(windows_done, len(self.windows))
        samples = epoch * sum(self.windows) + sum(self.windows[:window])
        return {
            **{key: getattr(self, key) for key in STATE_KEYS},
            "micro_batch_size": self.layout.micro_batch_size,
            "world_size": self.layout.world_size,
            "epoch": epoch,
            "window": window,
            "micro_batches_done": micro_batches_done,
            "samples": samples,
        }

    def check_resumable(self, state: dict[str, Any]) -> None:
        """Refuse, naming what differs, a position from another run's windows (another dataset length, batch, order,
        seed) or one taken mid-window on another layout."""
        run = self.state_dict(0)
        for key in STATE_KEYS:
            if state[key] != run[key]:
                raise ValueError(
                    f"Cannot resume: the checkpoint's run has {key}={state[key]!r}, this one {key}={run[key]!r}, so "
                    "its windows cannot be matched (a run's windows are defined by the dataset length, "
                    "`effective_batch_size`, the order and its seed)."
                )
        same_layout = (state["micro_batch_size"], state["world_size"]) == (
            self.layout.micro_batch_size,
            self.layout.world_size,
        )
        if state["micro_batches_done"] and not same_layout:
            raise ValueError(
                f"Cannot resume: the checkpoint was taken mid-window ({state['micro_batches_done']} micro-batches of "
                f"window {state['window']} done, micro-batch {state['micro_batch_size']} on {state['world_size']} "
                f"processes); its partly accumulated gradients belong to that layout's shares. Resume on that layout "
                "(micro-batch and processes), or from a checkpoint taken at a window's end."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from [`state_dict`]'s position (checked by [`check_resumable`]): the next iteration follows the
        saved epoch's order from the saved window and micro-batch."""
        self.check_resumable(state)
        self.epoch = state["epoch"]
        self._start = (state["window"], state["micro_batches_done"])
