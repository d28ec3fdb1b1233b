"""Run a function on `world_size` fresh gloo CPU processes (`torch.multiprocessing.spawn`), one free port each run.

`fn(rank, world_size, *args)` runs inside an initialised default process group (one thread per process, so the
processes share the machine's cores fairly) that is torn down after it returns.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Spawn `world_size` processes running `fn(rank, world_size, *args)`; an exception in any rank raises here."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size)
