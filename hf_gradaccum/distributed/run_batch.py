"""`effective_batch_size` in the Trainer: the run's batch on any number of processes, resumed on any layout.

With `effective_batch_size=B`, `per_device_train_batch_size` is the micro-batch that fits and
`gradient_accumulation_steps` is derived ([`RunBatchLayout`]). The training loader is the stock Trainer's, except for
its batch sampler: a [`RunBatchSampler`] yielding every rank's micro-batches of each window interleaved, which
Accelerate's `prepare` deals out to the ranks unchanged (its batches vary in size, so it is told none). The Trainer's
loop is untouched: every rank runs `gradient_accumulation_steps` micro-batches per window (fewer, equally on every
rank, in a shorter last window), so its window boundaries, its steps per epoch (the number of windows, whatever the
layout) and its fast-forward on resume (`windows done x micro-batches per window`) all land on the run's windows.

Checkpoints record the run (dataset length, batch, order, seed) and the layout it ran on beside the accumulator's state;
a resume on another layout continues the same windows, and one whose windows cannot be matched is refused.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback

from ..config.run_batch_arguments import resolve_run_batch_arguments, sampling_strategy
from ..engine.run_batch.layout import RunBatchLayout
from ..engine.run_batch.sampler import RunBatchSampler
from ..engine.sharded.tensor_parallel import has_tensor_parallel_parameters
from ..helpers.planning import halved_run_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkPlan:
    """After an out-of-memory error: rows per forward, forwards per window on the largest share, the run's batch."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    effective_batch_size: int


class RunBatchMode:
    """
    The Trainer's side of `effective_batch_size`: its training loader, the epoch of its order, and the run's
    record in checkpoints. Built by `GradAccumTrainer` when the field is set ([`for_trainer`]).

    Args:
        trainer (`Trainer`): the trainer whose arguments set `effective_batch_size`.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.sampler: RunBatchSampler | None = None
        # Refused before any work: a loader or sampler of the trainer's own would not follow the run's windows.
        for name in ("_get_train_sampler", "get_train_dataloader"):
            owner = _defining_class(type(trainer), name)
            if owner is not Trainer and not vars(owner).get("_honours_run_batch", False):
                raise ValueError(
                    f"`effective_batch_size` cannot be used with {owner.__name__}.{name}, which builds the training "
                    "batches itself: the run's windows could not be honoured. Drop `effective_batch_size` (and give "
                    "`per_device_train_batch_size x gradient_accumulation_steps x processes`), or the override."
                )
        dataset = trainer.train_dataset
        if isinstance(dataset, IterableDataset) or (dataset is not None and not hasattr(dataset, "__len__")):
            raise ValueError(
                "`effective_batch_size` needs a training dataset with a length (the run's windows and order are "
                f"defined by it); got {type(dataset).__name__}."
            )
        trainer.add_callback(_RunOrderEpochCallback(self))

    @classmethod
    def for_trainer(cls, trainer: Trainer) -> RunBatchMode | None:
        """The mode for `trainer`, or `None` when its arguments leave `effective_batch_size` unset."""
        if getattr(trainer.args, "effective_batch_size", None) is None:
            return None
        if has_tensor_parallel_parameters(list(trainer.model.parameters())):
            # Ranks of one tensor-parallel group share their batch: the window's shares would be laid out over every
            # process instead of over the data-parallel ranks alone.
            raise ValueError(
                "`effective_batch_size` cannot be used with tensor parallelism yet: its windows are split over every "
                "process, while ranks of a tensor-parallel group share one batch. Set `per_device_train_batch_size` "
                "and `gradient_accumulation_steps` instead (docs/engines_tp_hsdp.md)."
            )
        resolve_run_batch_arguments(trainer.args, trainer.args.world_size)
        return cls(trainer)

    @property
    def effective_batch_size(self) -> int:
        return self.trainer.args.effective_batch_size

    def layout(self) -> RunBatchLayout:
        """The layout of the current micro-batch (the stock `auto_find_batch_size` may have lowered it)."""
        args = self.trainer.args
        return RunBatchLayout(self.effective_batch_size, self.trainer._train_batch_size, args.world_size)

    def train_dataloader(self) -> DataLoader:
        """The stock training loader with a [`RunBatchSampler`] as its batch sampler, prepared by Accelerate."""
        trainer, args = self.trainer, self.trainer.args
        dataset, collator = trainer.train_dataset, trainer.data_collator
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if _is_datasets_dataset(dataset):
            dataset = trainer._remove_unused_columns(dataset, description="Training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="Training")
        layout = self.layout()
        if args.gradient_accumulation_steps != layout.gradient_accumulation_steps:
            # The stock `auto_find_batch_size` restarted the loop at a smaller micro-batch: more per window.
            logger.warning(
                "Micro-batch %d: %d micro-batches per window (effective batch %d unchanged).",
                layout.micro_batch_size,
                layout.gradient_accumulation_steps,
                layout.effective_batch_size,
            )
            args.gradient_accumulation_steps = args._run_batch_steps = layout.gradient_accumulation_steps
        seed = args.data_seed if args.data_seed is not None else args.seed
        self.sampler = RunBatchSampler(
            len(dataset),
            layout.effective_batch_size,
            layout.micro_batch_size,
            world_size=layout.world_size,
            shuffle=sampling_strategy(args) == "random",
            seed=seed,
            drop_last=args.dataloader_drop_last,
        )
        params: dict[str, Any] = {
            "batch_sampler": self.sampler,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
        }
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
            params["worker_init_fn"] = _worker_init(args)
        logger.info(
            "Run's batch: %s rows per window on %d process(es), %d micro-batch(es) of at most %d each.",
            layout.describe(layout.effective_batch_size),
            layout.world_size,
            layout.gradient_accumulation_steps,
            layout.micro_batch_size,
        )
        return trainer.accelerator.prepare(DataLoader(dataset, **params))

    def halved(self, chunk_size: int) -> ChunkPlan:
        """The out-of-memory retry's plan: rows per forward halved from `chunk_size`; the windows and their
        micro-batches stay (each micro-batch runs in chunks)."""
        layout = self.layout()
        chunk = halved_run_batch(RunBatchLayout(self.effective_batch_size, chunk_size, layout.world_size))
        largest = layout.shares(self.effective_batch_size)[0]
        return ChunkPlan(chunk, math.ceil(largest / chunk), self.effective_batch_size)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any] | None:
        """The run and its position after `global_step` windows, for the checkpoint (`None` before training)."""
        if self.sampler is None:
            return None
        return self.sampler.state_dict(self.trainer.state.global_step)

    def check_resume(self, saved: dict[str, Any] | None, checkpoint: str) -> None:
        """Refuse, before any work, a checkpoint whose run's windows this one cannot continue (another dataset
        length, batch, order or seed); say which layout it ran on when that changes."""
        if saved is None:
            return
        args, dataset = self.trainer.args, self.trainer.train_dataset
        current = {
            "dataset_length": len(dataset),
            "effective_batch_size": self.effective_batch_size,
            "shuffle": sampling_strategy(args) == "random",
            "seed": args.data_seed if args.data_seed is not None else args.seed,
            "drop_last": args.dataloader_drop_last,
        }
        names = {
            "dataset_length": "the training dataset's length",
            "effective_batch_size": "`effective_batch_size`",
            "shuffle": "the order (`train_sampling_strategy`)",
            "seed": "the order's seed (`data_seed`/`seed`)",
            "drop_last": "`dataloader_drop_last`",
        }
        for key, value in current.items():
            if saved[key] != value:
                raise ValueError(
                    f"Cannot resume from {checkpoint}: its run had {names[key]} = {saved[key]!r}, this one has "
                    f"{value!r}, so its windows cannot be matched. Resume with the same data and run settings."
                )
        layout = self.layout()
        if (saved["micro_batch_size"], saved["world_size"]) != (layout.micro_batch_size, layout.world_size):
            logger.warning(
                "Resuming the run's batch from %s (window %d of epoch %d, %d samples) on another layout: micro-batch "
                "%d on %d process(es) (checkpoint: %d on %d). The windows, schedule and optimizer state continue.",
                checkpoint,
                saved["window"],
                saved["epoch"],
                saved["samples"],
                layout.micro_batch_size,
                layout.world_size,
                saved["micro_batch_size"],
                saved["world_size"],
            )


class _RunOrderEpochCallback(TrainerCallback):
    """Sets the epoch of the run's order at each epoch's start. The Trainer's own `set_epoch` does not reach the
    sampler through the loader it fast-forwards on resume, so the epoch is counted here from the global step."""

    def __init__(self, mode: RunBatchMode) -> None:
        self.mode = mode
        self.next_epoch = 0

    def on_train_begin(self, args, state, control, **kwargs):
        sampler = self.mode.sampler
        if sampler is not None:
            self.next_epoch = state.global_step // len(sampler.windows)
        return control

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.mode.sampler is not None:
            self.mode.sampler.set_epoch(self.next_epoch)
        self.next_epoch += 1
        return control


def _defining_class(cls: type, name: str) -> type:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return Trainer


def _is_datasets_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _worker_init(args: Any) -> Any:
    from transformers.trainer_utils import seed_worker

    if len(inspect.signature(seed_worker).parameters) >= 3:
        return partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index)
    return seed_worker
