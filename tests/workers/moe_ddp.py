"""2-process (gloo) worker for `tests/test_moe_balance.py`: exact window-level MoE load balancing under DDP.

`accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/workers/moe_ddp.py OUT_DIR` trains a tiny
Mixtral for 2 windows on each rank's uneven, padded micro-batches, in `"window"` and `"micro_batch"` modes, and
writes each mode's relative update error against the large batch over *all* ranks' samples (one padded batch, the
model's own CE + coef * aux) to `OUT_DIR/moe_ddp_rank{r}.json`.
"""

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_gradaccum import GradientAccumulator, count_items_in_batch  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from hf_gradaccum.losses.moe import WindowRouterBalance  # noqa: E402
from tests.composition_cases import flat_trainable, pad_cat, sgd_reference, tiny_mixtral, update_error  # noqa: E402
from tests.test_moe_balance import PAD, _collate, _rows, large_batch_loss  # noqa: E402

# window -> rank -> micro-batch sizes (same number of micro-batches per rank, different rows and items)
SIZES = [[[3, 1], [2, 2]], [[2, 2], [1, 3]]]


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    start = tiny_mixtral()
    rows = _rows(sum(sum(sum(r) for r in w) for w in SIZES))
    local, global_windows, offset = [], [], 0
    for window in SIZES:
        per_rank = []
        for sizes in window:
            batches = []
            for size in sizes:
                batches.append(_collate(rows[offset : offset + size]))
                offset += size
            per_rank.append(batches)
        local.append(per_rank[rank])
        global_windows.append([b for batches in per_rank for b in batches])
    reference = sgd_reference(start, global_windows, large_batch_loss)
    initial = flat_trainable(start)
    record = {"rank": rank}
    for mode in ("window", "micro_batch"):
        model = copy.deepcopy(start).train()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        accumulator = GradientAccumulator(ddp, gradient_accumulation_steps=2)
        balance = WindowRouterBalance(ddp) if mode == "window" else None
        for window in local:
            if balance is not None:
                items = balance.prepare_window(window)
                record.setdefault("window_aux", []).append(balance.window_aux_loss)
            else:
                items = [count_items_in_batch(b, shift_labels=True) for b in window]
            for batch, n in zip(window, items, strict=True):
                with accumulator.accumulate(ddp):
                    loss = balance.micro_batch_loss(batch, n) if balance is not None else ddp(**batch).loss
                    accumulator.backward(loss, num_items=n)
            accumulator.step(optimizer)
        accumulator.remove_hooks()
        record[mode] = update_error(initial, model, reference)
    with torch.no_grad():
        record["large_batch_aux"] = [
            float(start(**pad_cat(w, PAD), output_router_logits=True).aux_loss) for w in global_windows[:1]
        ]
    Path(out_dir, f"moe_ddp_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group_and_exit(0)  # barrier, destroy, and an exit that cannot abort in gloo's teardown
