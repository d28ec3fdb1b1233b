"""The run's batch: which rows form each window, and which of them each rank runs in which micro-batch.

A run is defined by its data order and its effective batch `B`: window `w` is rows `[wB, (w+1)B)` of the epoch's order
(the last window holds what is left). How those rows are laid out on hardware is a separate choice: `world_size`
processes, each running micro-batches of at most `micro_batch_size` rows. Because the accumulator weights every
micro-batch by its items and sums items across ranks, any layout of a window's rows gives the window's large-batch
update, so the layout may be uneven (10 rows on 3 ranks: 4 + 3 + 3) and may change between a checkpoint and its resume.

Two constraints come from the collectives, not the arithmetic: every rank runs the same number of micro-batches in a
window (DDP, FSDP2 and DeepSpeed synchronise per micro-batch or per window), and no micro-batch is empty (a model
cannot run a forward on zero rows). [`RunBatchLayout`] splits each window's rows over the ranks as evenly as possible
(shares differ by at most one row), gives every rank `ceil(largest share / micro_batch_size)` micro-batches, splits each
share evenly into them, and refuses a layout where some share is smaller than that count, naming the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..validation import check_positive_int


@dataclass(frozen=True)
class RunBatchLayout:
    """
    How each window of `effective_batch_size` rows is split over `world_size` ranks and micro-batches of at most
    `micro_batch_size` rows. Checked on construction: a layout that would leave a rank an empty micro-batch in a full
    window is refused with the reason.

    Args:
        effective_batch_size (`int`): rows per window (per optimizer step), over all ranks.
        micro_batch_size (`int`): largest micro-batch a rank runs (`per_device_train_batch_size`).
        world_size (`int`, *optional*, defaults to 1): data-parallel processes.

    Example:

    ```python
    >>> from hf_gradaccum.engine.run_batch.layout import RunBatchLayout
    >>> layout = RunBatchLayout(effective_batch_size=10, micro_batch_size=2, world_size=3)
    >>> layout.shares(10), layout.gradient_accumulation_steps
    ([4, 3, 3], 2)
    >>> layout.rank_micro_batches(10, rank=1)
    [[4, 5], [6]]
    ```
    """

    effective_batch_size: int
    micro_batch_size: int
    world_size: int = 1

    def __post_init__(self) -> None:
        check_positive_int(self.effective_batch_size, "effective_batch_size")
        check_positive_int(self.micro_batch_size, "micro_batch_size")
        check_positive_int(self.world_size, "world_size")
        reason = self.why_not(self.effective_batch_size)
        if reason is not None:
            raise ValueError(f"`effective_batch_size={self.effective_batch_size}`: {reason}")

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches every rank runs in a full window."""
        return self.micro_batches(self.effective_batch_size)

    def shares(self, rows: int) -> list[int]:
        """Rows of a window of `rows` each rank runs: as even as possible, the larger shares first."""
        base, extra = divmod(rows, self.world_size)
        return [base + (rank < extra) for rank in range(self.world_size)]

    def micro_batches(self, rows: int) -> int:
        """Micro-batches every rank runs in a window of `rows`: enough for the largest share."""
        return math.ceil(math.ceil(rows / self.world_size) / self.micro_batch_size)

    def why_not(self, rows: int) -> str | None:
        """Why a window of `rows` cannot be laid out (some rank would get an empty micro-batch), or `None`."""
        count, smallest = self.micro_batches(rows), min(self.shares(rows))
        if smallest >= count:
            return None
        if smallest == 0:
            return (
                f"{rows} rows cannot be split over {self.world_size} processes without a process that has no row "
                f"(every process must run the window's micro-batches). Use at least {self.world_size} rows per window."
            )
        return (
            f"{rows} rows on {self.world_size} processes give shares {self.describe(rows)}; with micro-batches of at "
            f"most {self.micro_batch_size} rows every process must run {count} micro-batches, but a share of "
            f"{smallest} rows cannot fill {count} of them without an empty one. Use `per_device_train_batch_size` >= 2 "
            f"or a number of rows divisible by {self.world_size}."
        )

    def rank_micro_batches(self, rows: int, rank: int) -> list[list[int]]:
        """Positions in a window of `rows` (0 to `rows - 1`) of each micro-batch `rank` runs: its contiguous share,
        split as evenly as possible into [`micro_batches`] parts."""
        shares = self.shares(rows)
        start = sum(shares[:rank])
        count = self.micro_batches(rows)
        sizes = [shares[rank] // count + (k < shares[rank] % count) for k in range(count)]
        batches, offset = [], start
        for size in sizes:
            batches.append(list(range(offset, offset + size)))
            offset += size
        return batches

    def describe(self, rows: int) -> str:
        """`"10 = 4+3+3"`: a window's rows and the ranks' shares."""
        return f"{rows} = {'+'.join(map(str, self.shares(rows)))}"


def window_rows(dataset_length: int, effective_batch_size: int, drop_last: bool = False) -> list[int]:
    """
    Rows of each window of an epoch: full windows of `effective_batch_size`, then what is left unless `drop_last`.

    Example:

    ```python
    >>> from hf_gradaccum.engine.run_batch.layout import window_rows
    >>> window_rows(38, 10), window_rows(38, 10, drop_last=True)
    ([10, 10, 10, 8], [10, 10, 10])
    ```
    """
    full, rest = divmod(dataset_length, effective_batch_size)
    return [effective_batch_size] * full + ([rest] if rest and not drop_last else [])


def run_batch_accumulation_steps(
    effective_batch_size: int, micro_batch_size: int | None, world_size: int, gradient_accumulation_steps: int = 1
) -> int:
    """
    Micro-batches per window for a run's batch on `world_size` processes; an explicit `gradient_accumulation_steps`
    other than 1 (the default) must agree, else a `ValueError` names both.

    Example:

    ```python
    >>> from hf_gradaccum.engine.run_batch.layout import run_batch_accumulation_steps
    >>> run_batch_accumulation_steps(10, micro_batch_size=2, world_size=4)  # 3+3+2+2 rows, 2 micro-batches each
    2
    ```
    """
    if micro_batch_size is None:
        raise ValueError("`effective_batch_size` needs `micro_batch_size`: the largest micro-batch a process runs.")
    layout = RunBatchLayout(effective_batch_size, micro_batch_size, world_size)
    steps = layout.gradient_accumulation_steps
    if gradient_accumulation_steps not in (1, steps):
        raise ValueError(
            f"`gradient_accumulation_steps={gradient_accumulation_steps}` does not match `effective_batch_size="
            f"{effective_batch_size}` in micro-batches of at most {micro_batch_size} on {world_size} process(es), "
            f"which need {steps} per window (shares {layout.describe(effective_batch_size)}). Leave it unset."
        )
    return steps
