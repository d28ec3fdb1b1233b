"""Entry point for the multi-process tests: `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml
tests/workers/run_ddp.py WORKER ARG...` runs `tests.workers.ddp_workers.WORKER(*ARGS)` on every rank."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

from tests.workers import ddp_workers  # noqa: E402

if __name__ == "__main__":
    from hf_gradaccum.engine.process_exit import leave_process_group_and_exit

    getattr(ddp_workers, sys.argv[1])(*sys.argv[2:])
    # Leave together, and exit without the interpreter teardown in which gloo can abort a passed run.
    leave_process_group_and_exit(0)
