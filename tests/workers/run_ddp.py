"""Entry point for the multi-process tests: `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml
tests/workers/run_ddp.py WORKER ARG...` runs `tests.workers.ddp_workers.WORKER(*ARGS)` on every rank."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

from tests.workers import ddp_workers  # noqa: E402

if __name__ == "__main__":
    import torch.distributed as dist

    getattr(ddp_workers, sys.argv[1])(*sys.argv[2:])
    if dist.is_initialized():
        # Leave together and tear gloo down explicitly: a rank that exits while the other still holds the group can
        # abort in gloo's destructor ("terminate called without an active exception"), failing a passed test.
        dist.barrier()
        dist.destroy_process_group()
