"""Functions run in 2 gloo processes by `accelerate.debug_launcher` (see tests/test_distributed.py). Each asserts
inside the worker; a failure in any rank fails the launcher."""

from __future__ import annotations

import copy
import json
import os

import torch
from accelerate import Accelerator
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


def plain_loop_parity(case_name: str, out_dir: str) -> None:
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
    local_items = sum(count_items_in_batch(default_data_collator([data[i] for i in ix]), shift_labels=case.shift_labels) for ix in LAYOUT[rank])
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
