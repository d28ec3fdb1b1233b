"""2 gloo ranks: the overlapped DDP reduction (`overlap_reduction=True`, buckets launched from the fold hooks during
the last micro-batch) against the window-end reduction (`overlap_reduction=False`) on identical DDP models and data,
window by window, and both against the hand-computed large batch.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/workers/overlap_ddp.py OUT_DIR

Writes `overlap_rank{r}.json`; tests/test_overlap.py asserts on it.
"""

import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs  # noqa: E402
from torch import nn  # noqa: E402
from transformers import BertForSequenceClassification, default_data_collator  # noqa: E402

from hf_gradaccum import DynamicLossScaler, GradientAccumulator  # noqa: E402
from hf_gradaccum.helpers.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.parity_cases import (  # noqa: E402
    CASES,
    flat_params,
    relative_update_error,
    seq_cls_data,
    tiny_bert_config,
)

STEPS = 3
# A tiny cap (about 500 fp32 values): the tiny BERT's buffer is cut into many buckets, so their order matters.
BUCKET_CAP_MB = 0.002
# Per window, each rank's micro-batches (sample indices): uneven sizes, different on the two ranks.
WINDOWS = [
    # Full windows. `rare` (the last-registered parameter, so in the first bucket) is used by rank 0 only in an
    # earlier micro-batch and by rank 1 in its last one ...
    {0: [[0, 1, 2], [3], [4, 5]], 1: [[6], [7, 8, 9, 10], [11, 12]]},
    # ... then by rank 0 in its last micro-batch and not at all by rank 1 ...
    {0: [[13, 14], [15], [16, 17, 18]], 1: [[19, 20, 21], [22, 23], [24]]},
    # ... then by nobody (it keeps `.grad = None`).
    {0: [[25], [26, 27], [28]], 1: [[29, 30], [31], [32, 33]]},
    # Rank 1's last loss is NaN (its backward does not run): skipped on both ranks, same collectives.
    {0: [[34], [35], [36, 37]], 1: [[38], [39, 40], [41]]},
    # A partial window on both ranks (end of an epoch): reduced at its end.
    {0: [[42, 43], [44]], 1: [[45], [46, 47, 48]]},
    # Ranks disagree: full on rank 0 (overlapped), partial on rank 1 (window end); the collectives still pair.
    {0: [[49], [50, 51], [52]], 1: [[53, 54], [55]]},
]
RARE = {1, 11, 17, 44, 52}
NAN_WINDOW, NAN_RANK = 3, 1


class RareBranchClassifier(nn.Module):
    """A tiny BERT classifier whose `rare` head is applied only to flagged rows: a micro-batch without one leaves
    the head out of the graph (no gradient), as a mixture-of-experts or a task-specific head would."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = BertForSequenceClassification(tiny_bert_config(num_labels=3))
        self.rare = nn.Linear(3, 3)

    def forward(self, input_ids, attention_mask, rare):
        logits = self.bert(input_ids=input_ids, attention_mask=attention_mask).logits
        flagged = rare.bool()
        if bool(flagged.any()):
            logits = torch.where(flagged[:, None], self.rare(logits), logits)
        return logits


def batch_of(data, indices):
    batch = default_data_collator([data[i] for i in indices])
    batch["rare"] = torch.tensor([int(i in RARE) for i in indices])
    return batch


def mean_loss(model, batch):
    labels = batch["labels"]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], rare=batch["rare"])
    return F.cross_entropy(logits, labels)


def reference_run(initial, data):
    """The large batch: one SGD(lr=1) step per applied window on all of its samples over both ranks."""
    model = copy.deepcopy(initial)
    for w, window in enumerate(WINDOWS):
        if w == NAN_WINDOW:
            continue
        samples = [i for rank in (0, 1) for micro in window[rank] for i in micro]
        model.zero_grad()
        mean_loss(model, batch_of(data, samples)).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= p.grad
    return model


def fp32_windows(accelerator, rank, record) -> None:
    torch.manual_seed(0)
    initial = RareBranchClassifier()
    data = seq_cls_data(56, torch.Generator().manual_seed(5))
    runs = {}
    for overlap in (True, False):
        ddp_model = accelerator.prepare(copy.deepcopy(initial))
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1.0)
        acc = GradientAccumulator(ddp_model, STEPS, overlap_reduction=overlap, bucket_cap_mb=BUCKET_CAP_MB)
        runs[overlap] = (ddp_model, optimizer, acc)
    ours = runs[True][2]
    record["buckets"] = len(ours._overlap.buckets)
    record["bucket_params"] = [list(b.params) for b in ours._overlap.buckets]
    record["no_overlap_object"] = runs[False][2]._overlap is None
    # The default (None) on CPU buffers: off (gloo's reduction competes with the backward for the same cores).
    stopped = GradientAccumulator([torch.nn.Parameter(torch.zeros(2))], STEPS, overlap_reduction=True)
    had_overlap = stopped._overlap is not None
    stopped.stop_overlapping()
    record["stop_overlapping"] = [had_overlap, stopped._overlap is None]
    record["auto_overlap_on_cpu"] = (
        GradientAccumulator([torch.nn.Parameter(torch.zeros(2))], STEPS)._overlap is not None
    )
    record["bitwise_equal_after_window"] = []
    record["launched_during_backward"] = []
    record["applied"] = []
    record["collectives_per_window"] = []
    for w, window in enumerate(WINDOWS):
        rare_before = runs[True][0].module.rare.weight.detach().clone()
        for overlap, (ddp_model, optimizer, acc) in runs.items():
            before = acc.num_collectives
            micro_batches = window[rank]
            for m, indices in enumerate(micro_batches):
                with acc.accumulate(ddp_model):
                    loss = mean_loss(ddp_model, batch_of(data, indices))
                    if w == NAN_WINDOW and rank == NAN_RANK and m == len(micro_batches) - 1:
                        loss = loss * float("nan")
                    acc.backward(loss, num_items=len(indices))
            result = acc.step(optimizer)
            if overlap:
                record["launched_during_backward"].append(acc._overlap.launched_during_backward)
                record["applied"].append(result.applied)
                record["collectives_per_window"].append(acc.num_collectives - before)
        record.setdefault("rare_unchanged", []).append(torch.equal(rare_before, runs[True][0].module.rare.weight))
        record["bitwise_equal_after_window"].append(
            torch.equal(flat_params(runs[True][0].module), flat_params(runs[False][0].module))
        )
    reference = reference_run(initial, data)
    record["err_overlap"] = relative_update_error(initial, runs[True][0].module, reference)
    record["err_window_end"] = relative_update_error(initial, runs[False][0].module, reference)
    flat = flat_params(runs[True][0].module).float()
    gathered = [torch.empty_like(flat) for _ in range(2)]
    torch.distributed.all_gather(gathered, flat)
    record["ranks_bitwise_equal"] = torch.equal(gathered[0], gathered[1])


def fp16_recompute(accelerator, rank, record) -> None:
    """fp16 autocast + dynamic loss scaling, `overflow_policy="recompute"`: rank 1's LAST micro-batch of window 1
    overflows (a regression label of 300), so only rank 1 recomputes it; the overflowing attempt must launch
    nothing and both reductions must end bitwise equal."""
    case = next(c for c in CASES if c.name == "bert_regression")
    torch.manual_seed(0)
    initial = case.make_model()
    data = case.make_data(16, torch.Generator().manual_seed(3))
    labels = list(data["labels"])
    labels[4 + 2] = 300.0  # rank 1's share of window 0 starts at 4; its last micro-batch (of 2) starts at 6
    data = data.remove_columns("labels").add_column("labels", labels)
    outcome = {}
    for overlap in (True, False):
        ddp_model = accelerator.prepare(copy.deepcopy(initial))
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-3)
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1)
        acc = GradientAccumulator(ddp_model, 2, loss_scaler=scaler, overflow_policy="recompute",
                                  overlap_reduction=overlap, bucket_cap_mb=BUCKET_CAP_MB)  # fmt: skip
        launched = []
        for window in range(2):
            base = window * 8 + rank * 4
            for micro in range(2):
                batch = default_data_collator([data[i] for i in range(base + 2 * micro, base + 2 * micro + 2)])

                def compute_loss(batch=batch, model=ddp_model):
                    with torch.autocast("cpu", dtype=torch.float16):
                        return model(**batch).loss

                with acc.accumulate(ddp_model):
                    acc.accumulate_micro_batch(compute_loss, num_items=2)
            acc.step(optimizer)
            if overlap:
                launched.append(acc._overlap.launched_during_backward)
        outcome[overlap] = (flat_params(ddp_model.module), scaler.scale, acc.recomputed_micro_batches, launched)
        if overlap:
            record["fp16_buckets"] = len(acc._overlap.buckets)
    record["fp16_bitwise_equal"] = torch.equal(outcome[True][0], outcome[False][0])
    record["fp16_scales"] = [outcome[True][1], outcome[False][1]]
    record["fp16_recomputed"] = [outcome[True][2], outcome[False][2]]
    record["fp16_launched_during_backward"] = outcome[True][3]


def main(out_dir: str) -> None:
    # No buffer broadcast in DDP's forward: in the last window the ranks run different numbers of forwards, which
    # DDP's own broadcast could not pair (a DDP limit, not the accumulator's).
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    rank = accelerator.process_index
    record = {"rank": rank}
    fp32_windows(accelerator, rank, record)
    fp16_recompute(accelerator, rank, record)
    with open(os.path.join(out_dir, f"overlap_rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group_and_exit(0)  # barrier, destroy, and an exit that cannot abort in gloo's teardown
