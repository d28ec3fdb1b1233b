"""Worker for `tests/test_composition_kto_ddp.py`, run on 2 gloo processes by `accelerate launch`: a composed
KTOTrainer (`loss_type='kto'`, class order from the command line) trains one window of K = 3 micro-batches of 4 rows
per rank under DDP, on the 24 rows of one large batch. Rank 0 saves the update and the KL baselines TRL's loss
recorded to `OUTPUT_DIR/kto_ddp.pt`; the test compares them with the stock KTOTrainer on all 24 rows as one batch,
in one process.

Usage: `accelerate launch ... tests/workers/kto_ddp.py OUTPUT_DIR ORDER`.
"""

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.kto_cases import ORDERS, B, K, train_kto  # noqa: E402


def main(output_dir: str, order: str) -> None:
    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])  # the process group starts with the trainer
    run = train_kto(ORDERS[order], output_dir, ga=K, batch=B, rows=B * K * world)
    trainer = run.trainer
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    if dist.get_rank() == 0:
        torch.save(
            {"update": run.update, "kls": run.kls, "window_kl": trainer._kto_baseline.kl, "world_size": world},
            os.path.join(output_dir, "kto_ddp.pt"),
        )
        print(f"DDP x{world} {order} KTO kto: window KL {trainer._kto_baseline.kl:.6f}, loss KLs {run.kls}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
