"""Functions run in 2 gloo processes by `accelerate.debug_launcher` (see tests/test_distributed.py). Each asserts
inside the worker; a failure in any rank fails the launcher."""

from __future__ import annotations

import copy
import json
import os

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from transformers import default_data_collator

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator, count_items_in_batch
from tests.parity_cases import CASES, large_batch_reference, relative_update_error

CASE_BY_NAME = {c.name: c for c in CASES}
RTOL = 1e-5

# Per rank, the sample indices of each micro-batch of one window: uneven micro-batches, and (for the causal LM, whose
# rows have different lengths) different token counts on the two ranks.
LAYOUT = {0: [[0, 1, 2], [3]], 1: [[4], [5, 6, 7, 8, 9]]}


class CommCounter:
    """A DDP communication hook that counts the bucket all-reduces DDP itself performs."""

    def __init__(self):
        self.calls = 0

    def hook(self, state, bucket):
        self.calls += 1
        tensor = bucket.buffer()
        tensor.div_(torch.distributed.get_world_size())
        return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def fresh_accelerate_state() -> None:
    """The launcher forks the pytest process, whose Accelerate singletons may describe an earlier 1-process run."""
    AcceleratorState._reset_state(reset_partial_state=True)


def plain_loop_parity(case_name: str, out_dir: str) -> None:
    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    initial = copy.deepcopy(model)
    data = case.make_data(10, torch.Generator().manual_seed(1))

    ddp_model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    counter = CommCounter()
    ddp_model.register_comm_hook(None, counter.hook)
    acc = GradientAccumulator(ddp_model, gradient_accumulation_steps=2)
    for indices in LAYOUT[rank]:
        batch = default_data_collator([data[i] for i in indices])
        with acc.accumulate(ddp_model):
            loss = ddp_model(**batch).loss
            acc.backward(loss, num_items=count_items_in_batch(batch, shift_labels=case.shift_labels))
    result = acc.step(optimizer)

    reference = large_batch_reference(case, initial, data, [list(range(10))])
    err = relative_update_error(initial, accelerator.unwrap_model(ddp_model), reference)
    local_items = sum(
        count_items_in_batch(default_data_collator([data[i] for i in ix]), shift_labels=case.shift_labels)
        for ix in LAYOUT[rank]
    )
    # The stock path for comparison: plain DDP backward on every micro-batch, all-reducing each time.
    stock = accelerator.prepare(copy.deepcopy(initial))
    stock_counter = CommCounter()
    stock.register_comm_hook(None, stock_counter.hook)
    for indices in LAYOUT[rank]:
        batch = default_data_collator([data[i] for i in indices])
        stock(**batch).loss.backward()
    record = {
        "rank": rank,
        "err": err,
        "local_items": local_items,
        "window_items": result.num_items,
        "ddp_allreduces_ours": counter.calls,
        "flat_buffer_reductions_ours": acc.num_gradient_reductions,
        "ddp_allreduces_stock": stock_counter.calls,
    }
    with open(os.path.join(out_dir, f"{case_name}_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    assert err <= RTOL, record
    assert counter.calls == 0 and acc.num_gradient_reductions == 1, record


def trainer_parity(case_name: str, out_dir: str) -> None:
    """GradAccumTrainer under 2-process DDP vs the large-batch SGD steps over both ranks' samples."""
    fresh_accelerate_state()
    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    initial = copy.deepcopy(model)
    data = case.make_data(16, torch.Generator().manual_seed(2))
    args = GradAccumArguments(
        output_dir=os.path.join(out_dir, "trainer"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    rank = trainer.args.process_index
    # Accelerate deals sequential batches of 2 round-robin over the ranks: a window (2 micro-batches x 2 ranks)
    # covers 8 consecutive samples.
    reference = large_batch_reference(case, initial, data, [list(range(0, 8)), list(range(8, 16))])
    err = relative_update_error(initial, trainer.model, reference)
    record = {"rank": rank, "err": err, "reductions": trainer.accumulator.num_gradient_reductions}
    with open(os.path.join(out_dir, f"trainer_{case_name}_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    assert trainer.state.global_step == 2
    assert trainer.accumulator.num_gradient_reductions == 2
    assert err <= RTOL, record


def fp16_overflow_consistency(policy: str, inject: str, out_dir: str) -> None:
    """fp16 (CPU autocast) + dynamic loss scaling on 2 ranks; with `inject == "yes"` only rank 1's micro-batch 2 of
    the first window overflows (a regression label of 300: its scaled gradient exceeds fp16's range, its loss does
    not). Checks that both ranks take the same decision and end bitwise identical."""
    from hf_gradaccum import DynamicLossScaler

    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    case = CASE_BY_NAME["bert_regression"]
    torch.manual_seed(0)
    model = case.make_model()
    initial = copy.deepcopy(model)
    data = case.make_data(32, torch.Generator().manual_seed(3))  # 2 windows x 2 ranks x 4 micro-batches x 2
    labels = list(data["labels"])
    overflow_sample = 8 + 2 * 2  # rank 1's share of window 1 starts at 8; its micro-batch 2 starts at 12
    if inject == "yes":
        labels[overflow_sample] = 300.0
    data = data.remove_columns("labels").add_column("labels", labels)

    ddp_model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1)
    acc = GradientAccumulator(ddp_model, 4, loss_scaler=scaler, overflow_policy=policy)
    window_samples = []
    for window in range(2):
        base = window * 16 + rank * 8
        for micro in range(4):
            indices = list(range(base + 2 * micro, base + 2 * micro + 2))
            batch = default_data_collator([data[i] for i in indices])

            def compute_loss(batch=batch):
                with torch.autocast("cpu", dtype=torch.float16):
                    return ddp_model(**batch).loss

            with acc.accumulate(ddp_model):
                if policy == "recompute":
                    acc.accumulate_micro_batch(compute_loss, num_items=2)
                else:
                    acc.backward(compute_loss(), num_items=2)
        acc.step(optimizer)
        window_samples.append(list(range(window * 16, window * 16 + 16)))

    flat = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(ddp_model).parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    scales = [None] * world
    torch.distributed.all_gather_object(scales, scaler.scale)
    record = {
        "rank": rank,
        "weights_bitwise_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "scales": scales,
        "applied": acc.applied_steps,
        "skipped": dict(acc.skipped_steps),
        "recomputed": acc.recomputed_micro_batches,
        "gradient_reductions": acc.num_gradient_reductions,
        "collectives": acc.num_collectives,
        "unchanged": torch.equal(flat, torch.cat([p.detach().flatten() for p in initial.parameters()])),
    }
    if policy == "recompute":
        reference = large_batch_reference(case, initial, data, window_samples, lr=1e-3)
        record["err"] = relative_update_error(initial, accelerator.unwrap_model(ddp_model), reference)
    with open(os.path.join(out_dir, f"fp16_{policy}_{inject}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


def sharded_engines_refused(out_dir: str) -> None:
    """FSDP through the Trainer is refused with a clear error; FSDP2 (`fully_shard`) in a plain loop is accepted
    (its parity is tested in tests/test_fsdp2.py)."""
    from torch.distributed.fsdp import fully_shard

    fresh_accelerate_state()
    case = CASE_BY_NAME["bert_seq_cls"]
    messages = {}
    args = GradAccumArguments(
        output_dir=os.path.join(out_dir, "fsdp"), fsdp="full_shard", use_cpu=True, report_to=[], save_strategy="no"
    )
    try:
        GradAccumTrainer(model=case.make_model(), args=args, train_dataset=case.make_data(4, torch.Generator()))
    except ValueError as error:
        messages["trainer"] = str(error)
    torch.distributed.barrier()
    model = case.make_model()
    fully_shard(model)
    try:
        messages["plain_sharded"] = GradientAccumulator(model, 2).sharded
    except ValueError as error:
        messages["plain"] = str(error)
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"refused_rank{rank}.json"), "w") as f:
        json.dump(messages, f)
