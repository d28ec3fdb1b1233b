"""Run a worker function on N fresh gloo CPU processes (one process group), for the FSDP2 workers (NCCL on GPUs with
`FSDP2_TEST_DEVICE=cuda`, for the workers that support it).

`worker(rank, world_size, *args)` runs after `init_process_group("gloo")` with one thread per process; a final
barrier keeps a fast rank from tearing the group down under a slow one. Processes are started with `spawn` (fresh
interpreters), and their exit codes are returned, so a caller can tell a crash from a deliberate `SIGKILL` (-9).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.multiprocess import free_port  # noqa: E402

# A rank that crashed leaves the others blocked in a collective; they are terminated (SIGTERM, exit code -15, so
# not mistaken for a deliberate SIGKILL) this long after it.
GRACE_S = 10.0


def worker_device() -> torch.device:
    """`cpu` (gloo), or `cuda` with `FSDP2_TEST_DEVICE=cuda` (NCCL, one GPU per rank), for a run on a lent GPU."""
    return torch.device(os.environ.get("FSDP2_TEST_DEVICE", "cpu"))


def _entry(rank: int, worker: Callable[..., None], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if worker_device().type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if worker_device().type == "cuda" else "gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        worker(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group_and_exit(0)  # barrier, destroy, and an exit that cannot abort in gloo's teardown


def spawn_gloo(worker: Callable[..., None], world_size: int, *args: object, timeout: float = 300.0) -> list[int]:
    """Run `worker(rank, world_size, *args)` on `world_size` processes; return their exit codes (0: success,
    negative: killed by that signal)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, worker, world_size, port, args)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(proc.is_alive() for proc in procs):
        procs[0].join(0.1)
        now = time.monotonic()
        if failed_at is None and any(proc.exitcode not in (None, 0) for proc in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > GRACE_S):
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
    for proc in procs:
        proc.join()
    return [proc.exitcode for proc in procs]


def run_gloo(worker: Callable[..., None], world_size: int, *args: object) -> None:
    """[`spawn_gloo`], exiting with an error unless every rank succeeded."""
    codes = spawn_gloo(worker, world_size, *args)
    if any(codes):
        raise SystemExit(f"worker {worker.__name__} on {world_size} processes exited with codes {codes}")
