"""The run's batch in one process: the layout of a window over any number of ranks (as Accelerate really deals it
out), the order that does not depend on the layout, the derived `gradient_accumulation_steps`, every refusal, and the
plain loop (`RunBatchSampler` + `GradientAccumulator(effective_batch_size=...)`) against the large batch, resumed
mid-window. The multi-process runs are in tests/test_run_batch_distributed.py."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import DataLoader
from transformers import BertForSequenceClassification, TrainingArguments, default_data_collator

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator
from hf_gradaccum.config.run_batch_arguments import resolve_run_batch_arguments
from hf_gradaccum.engine.run_batch.layout import RunBatchLayout
from hf_gradaccum.engine.run_batch.sampler import RunBatchSampler
from hf_gradaccum.helpers.planning import plan_accumulation
from tests.ordering import HAS_SAMPLING_STRATEGY
from tests.parity_cases import CASES, relative_update_error, seq_cls_data, tiny_bert_config
from tests.workers.run_batch_cases import initial_model_and_data, our_run, run_settings

CASE = {c.name: c for c in CASES}["bert_token_cls"]
needs_sampling_strategy = pytest.mark.skipif(not HAS_SAMPLING_STRATEGY, reason="needs train_sampling_strategy")


# ---------------------------------------------------------------------------------------------------- layout and order
@pytest.mark.parametrize(
    ("world_size", "micro", "shares", "steps"),
    [(1, 4, [10], 3), (2, 4, [5, 5], 2), (3, 2, [4, 3, 3], 2), (4, 2, [3, 3, 2, 2], 2), (4, 4, [3, 3, 2, 2], 1)],
)
def test_layout_splits_a_window_evenly_with_the_same_micro_batches_on_every_rank(world_size, micro, shares, steps):
    layout = RunBatchLayout(10, micro, world_size)
    assert layout.shares(10) == shares and layout.gradient_accumulation_steps == steps
    positions = []
    for rank in range(world_size):
        batches = layout.rank_micro_batches(10, rank)
        assert len(batches) == steps and all(0 < len(b) <= micro for b in batches)
        assert sum(map(len, batches)) == shares[rank]
        positions += [i for b in batches for i in b]
    assert positions == list(range(10))


@pytest.mark.parametrize("shuffle", [False, True])
def test_windows_are_the_runs_for_every_layout_as_accelerate_deals_them_out(shuffle):
    """Through Accelerate's own `BatchSamplerShard` (what `accelerator.prepare` wraps a batch sampler in): rank `r`
    gets its micro-batches, every rank the same number per window, and the window's rows are `[wB, (w+1)B)` of the
    epoch's order, which is `torch.randperm(n)` from `seed + epoch` (or the rows in order) for every layout."""
    n, batch, seed, epoch = 38, 10, 7, 3
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle else None
    order = order or list(range(n))
    for world_size in (1, 2, 3, 4):
        for micro in (2, 3, 5, 10):
            sampler = RunBatchSampler(n, batch, micro, world_size=world_size, shuffle=shuffle, seed=seed)
            sampler.set_epoch(epoch)
            per_rank = [list(BatchSamplerShard(sampler, world_size, r, even_batches=True)) for r in range(world_size)]
            own = [list(_with_epoch(RunBatchSampler(n, batch, micro, world_size=world_size, rank=r, shuffle=shuffle,
                                                    seed=seed), epoch)) for r in range(world_size)]  # fmt: skip
            assert per_rank == own
            counts = [sampler.layout.micro_batches(rows) for rows in sampler.windows]
            assert all(len(batches) == sum(counts) for batches in per_rank)
            start = 0
            for w, count in enumerate(counts):
                rows = sorted(i for batches in per_rank for b in batches[start : start + count] for i in b)
                assert rows == sorted(order[w * batch : (w + 1) * batch]), (world_size, micro, w)
                start += count


def _with_epoch(sampler: RunBatchSampler, epoch: int) -> RunBatchSampler:
    sampler.set_epoch(epoch)
    return sampler


def test_layouts_that_would_need_an_empty_micro_batch_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"effective_batch_size=10.*3\+3\+2\+2.*cannot fill 3"):
        RunBatchLayout(10, 1, 4)  # micro-batch 1: a share of 2 rows cannot run 3 micro-batches
    with pytest.raises(ValueError, match="effective_batch_size=3.*without a process that has no row"):
        RunBatchLayout(3, 2, 4)
    with pytest.raises(ValueError, match="last window.*dataloader_drop_last=True"):
        RunBatchSampler(42, 10, 2, world_size=4)  # a last window of 2 rows on 4 processes
    assert len(RunBatchSampler(42, 10, 2, world_size=4, drop_last=True).windows) == 4
    with pytest.raises(ValueError, match="effective_batch_size"):
        RunBatchLayout(0, 2, 1)


# ---------------------------------------------------------------------------------------------------- arguments
def test_effective_batch_size_derives_gradient_accumulation_steps(tmp_path):
    args = GradAccumArguments(str(tmp_path), effective_batch_size=10, per_device_train_batch_size=4, use_cpu=True)
    assert args.gradient_accumulation_steps == 3
    same = GradAccumArguments(
        str(tmp_path),
        effective_batch_size=10,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        use_cpu=True,
    )
    assert same.gradient_accumulation_steps == 3
    assert resolve_run_batch_arguments(copy.copy(args), world_size=3).gradient_accumulation_steps == 1  # 4+3+3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"effective_batch_size": 0}, "`effective_batch_size` must be None or an integer >= 1, got 0"),
        ({"effective_batch_size": -4}, "`effective_batch_size` must be None or an integer >= 1"),
        ({"effective_batch_size": 10, "gradient_accumulation_steps": 4}, "`gradient_accumulation_steps=4` does not"),
        (
            {"effective_batch_size": 10, "accelerator_config": {"split_batches": True}},
            "cannot be used with `accelerator_config.split_batches=True`",
        ),
        pytest.param(
            {"effective_batch_size": 10, "train_sampling_strategy": "group_by_length"},
            "cannot be used with `train_sampling_strategy='group_by_length'`",
            marks=needs_sampling_strategy,
        ),
    ],
)
def test_bad_input_is_refused_naming_the_argument(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GradAccumArguments(str(tmp_path), per_device_train_batch_size=4, use_cpu=True, **kwargs)


def test_fewer_rows_per_window_than_processes_is_refused(tmp_path):
    args = GradAccumArguments(str(tmp_path), effective_batch_size=3, per_device_train_batch_size=4, use_cpu=True)
    with pytest.raises(ValueError, match="`effective_batch_size=3` is smaller than the number of processes \\(4\\)"):
        resolve_run_batch_arguments(args, world_size=4)


@needs_sampling_strategy
def test_a_trainer_with_its_own_sampler_or_an_iterable_dataset_is_refused(tmp_path):
    model, data = initial_model_and_data()
    args = GradAccumArguments(**run_settings(str(tmp_path), "sequential", per_device_train_batch_size=2,
                                             effective_batch_size=10))  # fmt: skip

    class OwnSampler(GradAccumTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return None

    with pytest.raises(
        ValueError, match="OwnSampler._get_train_sampler.*effective_batch_size|effective_batch_size.*Own"
    ):
        OwnSampler(model=model, args=args, train_dataset=data)
    args.max_steps = 4  # the stock Trainer's own requirement for a dataset without a length
    with pytest.raises(ValueError, match="needs a training dataset with a length"):
        GradAccumTrainer(model=model, args=args, train_dataset=data.to_iterable_dataset())


def test_planning_points_an_indivisible_batch_to_effective_batch_size():
    with pytest.raises(ValueError, match="effective_batch_size=64"):
        plan_accumulation(64, world_size=3)


# ---------------------------------------------------------------------------------------------------- resume refusals
@needs_sampling_strategy
def test_a_checkpoint_of_another_dataset_length_is_refused_before_any_work(tmp_path):
    our_run(str(tmp_path / "run"), "sequential", micro=4, save=True)
    model, data = initial_model_and_data()
    before = copy.deepcopy(model.state_dict())
    args = GradAccumArguments(**run_settings(str(tmp_path / "again"), "sequential", per_device_train_batch_size=4,
                                             effective_batch_size=10))  # fmt: skip
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=data.select(range(36)))
    with pytest.raises(ValueError, match="training dataset's length = 38, this one has 36"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# ---------------------------------------------------------------------------------------------------- plain loop
def _large_batch_run(model, data, windows, max_grad_norm=0.5):
    model = copy.deepcopy(model)
    optimizer, scheduler = _optimizer(model, len(windows))
    for rows in windows:
        loss = model(**default_data_collator([data[i] for i in rows])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model


def _optimizer(model, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2) * (1 - s / steps))


class PlainRun:
    """A plain loop on a `RunBatchSampler`: stops after `stop` micro-batches, or runs the epoch out."""

    def __init__(self, model, data, micro: int, batch: int = 10):
        self.model, self.data = model, data
        self.sampler = RunBatchSampler(len(data), batch, micro, rank=0, shuffle=False)
        self.loader = DataLoader(data, batch_sampler=self.sampler, collate_fn=default_data_collator)
        self.optimizer, self.scheduler = _optimizer(model, len(self.sampler.windows))
        self.acc = GradientAccumulator(model, effective_batch_size=batch, micro_batch_size=micro)

    def run(self, stop: int | None = None) -> None:
        for i, batch in enumerate(self.loader):
            if stop is not None and i == stop:
                return
            self.acc.backward(self.model(**batch).loss, batch=batch)
            if self.acc.sync_gradients:
                self.acc.step(self.optimizer, self.scheduler, max_grad_norm=0.5)
        self.acc.flush(self.optimizer, self.scheduler, max_grad_norm=0.5)

    def checkpoint(self) -> dict:
        windows = self.acc.applied_steps + sum(self.acc.skipped_steps.values())
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "accumulator": self.acc.state_dict(),
            "sampler": self.sampler.state_dict(windows, self.acc.micro_steps_in_window),
        }

    def load(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])  # first: it refuses a position it cannot continue
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.acc.load_state_dict(state["accumulator"])


def test_plain_loop_equals_the_large_batch_and_resumes_mid_window():
    """10 rows per window in micro-batches of at most 3 (3+3+2+2), AdamW with warmup and decay, clipping; stopped
    after window 1 and 2 micro-batches of window 2, resumed from that state on a fresh model and loader."""
    model, data = initial_model_and_data()
    reference = _large_batch_run(model, data, [list(range(w, min(w + 10, 38))) for w in range(0, 38, 10)])
    whole = PlainRun(copy.deepcopy(model), data, micro=3)
    assert whole.acc.gradient_accumulation_steps == 4
    whole.run()
    assert relative_update_error(model, whole.model, reference) <= 1e-5

    first = PlainRun(copy.deepcopy(model), data, micro=3)
    first.run(stop=6)
    state = first.checkpoint()
    assert state["sampler"]["window"] == 1 and state["sampler"]["micro_batches_done"] == 2
    assert state["sampler"]["samples"] == 10
    resumed = PlainRun(copy.deepcopy(model), data, micro=3)
    resumed.load(state)
    resumed.run()
    assert relative_update_error(model, resumed.model, reference) <= 1e-5

    other = PlainRun(copy.deepcopy(model), data, micro=4)
    with pytest.raises(ValueError, match="taken mid-window.*Resume on that layout"):
        other.load(state)
    shorter = PlainRun(copy.deepcopy(model), data.select(range(30)), micro=3)
    with pytest.raises(ValueError, match="dataset_length=38, this one dataset_length=30"):
        shorter.load(state)


def test_accumulator_refuses_inconsistent_accumulation_steps():
    with pytest.raises(ValueError, match="`gradient_accumulation_steps=2` does not match `effective_batch_size=10`"):
        GradientAccumulator(torch.nn.Linear(2, 1), 2, effective_batch_size=10, micro_batch_size=4)
    assert (
        GradientAccumulator(
            torch.nn.Linear(2, 1), effective_batch_size=10, micro_batch_size=4
        ).gradient_accumulation_steps
        == 3
    )


def test_stock_arguments_without_the_field_are_unchanged(tmp_path):
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, use_cpu=True)
    assert resolve_run_batch_arguments(args, world_size=3) is None and args.gradient_accumulation_steps == 2


# ---------------------------------------------------------------------------------------------------- out of memory
@needs_sampling_strategy
def test_out_of_memory_retry_keeps_the_runs_windows(tmp_path):
    """`auto_find_batch_size=True` with `effective_batch_size=12`: micro-batches of 6 (8 allowed) run out of memory
    half-way through a backward above 4 rows; the retry runs them in chunks of 4 and the run still ends at the
    large batch's weights, with its number of steps."""
    from tests.test_oom import MemoryLimitedBert, _args

    torch.manual_seed(0)
    config = tiny_bert_config(num_labels=3)
    limited = MemoryLimitedBert(config)
    limited.where, limited.max_rows = "backward", 4
    initial = copy.deepcopy(limited)
    data = seq_cls_data(36, torch.Generator().manual_seed(1))
    args = _args(tmp_path / "oom", 8, 1, auto_find_batch_size=True)
    args.effective_batch_size = 12
    resolve_run_batch_arguments(args, world_size=1)
    trainer = GradAccumTrainer(model=limited, args=args, train_dataset=data)
    trainer.train()
    plan = trainer.accumulation_plan
    assert (plan.micro_batch_size, plan.effective_batch_size, limited.large_calls > 1) == (4, 12, True)
    reference = BertForSequenceClassification(config)
    reference.load_state_dict(initial.state_dict())
    reference = GradAccumTrainer(model=reference, args=_args(tmp_path / "ref", 12, 1), train_dataset=data)
    reference.train()
    assert trainer.state.global_step == reference.state.global_step == 3
    assert relative_update_error(initial, trainer.model, reference.model) <= 1e-5


@needs_sampling_strategy
def test_random_order_follows_the_stock_permutation_in_every_epoch(tmp_path):
    """Two epochs in random order, micro-batch 3 (4 per window) against the stock Trainer's one-process run of the
    batch of 10: each epoch's permutation is drawn from `seed + epoch`, as the stock Trainer's."""
    from tests.workers.run_batch_cases import full_state, relative_error, stock_run

    initial, _ = initial_model_and_data()
    reference = stock_run(str(tmp_path / "stock"), "random", num_train_epochs=2)
    ours = our_run(str(tmp_path / "ours"), "random", micro=3, num_train_epochs=2)
    assert ours.state.global_step == reference.state.global_step == 8
    assert relative_error(full_state(ours), full_state(reference), initial) <= 1e-5
