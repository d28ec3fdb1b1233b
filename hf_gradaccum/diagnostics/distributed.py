"""The self-test's multi-process checks (`hf-gradaccum test --full`): DDP and FSDP2 on 2 local processes, each rank
accumulating its own uneven micro-batches, against the large batch of every rank's samples computed by hand.

Backends: gloo on CPU; NCCL with one GPU per rank where there are 2 GPUs; on a single GPU, DDP over gloo with both
ranks on it (FSDP2 is skipped there).
"""

from __future__ import annotations

import copy
import json
import socket
import tempfile
import time
from pathlib import Path

import torch

from .checks import FP32_RTOL, CheckResult, large_batch_gradient, relative_error
from .tiny_models import tiny_model, tiny_window

WORLD_SIZE = 2
# Rows per micro-batch on each rank (two micro-batches each, all different): the large batch is every row.
RANK_ROWS = ((3, 1), (2, 4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _placement(device: torch.device) -> tuple[str, bool] | str:
    """(backend, one GPU per rank), or the reason the check cannot run."""
    if device.type == "cpu":
        return "gloo", False
    if device.type == "cuda":
        return ("nccl", True) if torch.cuda.device_count() >= WORLD_SIZE else ("gloo", False)
    return f"no 2-process backend is set up for {device.type}"


def _rank_main(rank: int, mode: str, device_name: str, backend: str, per_rank_gpu: bool, port: int, out: str) -> None:
    import torch.distributed as dist

    from ..engine.accumulator import GradientAccumulator
    from ..engine.items import count_items_in_batch
    from ..engine.process_exit import leave_process_group_and_exit

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if per_rank_gpu else torch.device(device_name)
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device refuses a device without an index
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    windows = [tiny_window("causal-lm", device, rows, seed=10 + r) for r, rows in enumerate(RANK_ROWS)]
    model = tiny_model("causal-lm").to(device)
    reference = large_batch_gradient(copy.deepcopy(model), [b for w in windows for b in w], device)
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if per_rank_gpu else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    accumulator = GradientAccumulator(wrapped, len(windows[rank]))
    for batch in windows[rank]:
        with accumulator.accumulate(wrapped):
            loss = wrapped(**batch).loss
            accumulator.backward(loss, num_items=count_items_in_batch(batch, shift_labels=True))
    result = accumulator.finish_window()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    ours = torch.cat([g.detach().double().flatten() for g in grads])
    record = {"applied": result.applied, "relative_error": relative_error(ours, reference)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    leave_process_group_and_exit(0)  # a gloo group can abort a finished process in interpreter teardown


def _spawn_entry(rank: int, *args) -> None:
    _rank_main(rank, *args)


def check_two_processes(mode: str, device: torch.device, timeout: float = 240.0) -> CheckResult:
    """DDP (`mode="ddp"`) or FSDP2 (`mode="fsdp2"`) on 2 processes against the hand-computed large batch."""
    name = f"{mode}/2-processes"
    placement = _placement(device)
    if isinstance(placement, str):
        return CheckResult(name, "skip", detail=placement)
    backend, per_rank_gpu = placement
    if not torch.distributed.is_available() or not torch.distributed.is_backend_available(backend):
        return CheckResult(name, "skip", detail=f"torch.distributed backend {backend} is not available")
    if mode == "fsdp2":
        from ..engine.sharded.fsdp2_buffers import fsdp2_supported

        if not fsdp2_supported():
            return CheckResult(name, "skip", detail=f"FSDP2 accumulation needs torch>=2.8; found {torch.__version__}")
        if device.type == "cuda" and not per_rank_gpu:
            return CheckResult(name, "skip", detail="FSDP2 needs one GPU per rank (NCCL); 1 GPU found")
    import torch.multiprocessing as mp

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        args = (mode, str(device), backend, per_rank_gpu, _free_port(), out)
        context = mp.start_processes(_spawn_entry, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    return CheckResult(name, "fail", f"no result within {timeout:.0f} s", backend)
        except Exception as error:  # noqa: BLE001 (a crashed rank is this check's failure, reported in one line)
            last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            return CheckResult(name, "fail", "a rank crashed", last, time.perf_counter() - start)
        records = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    error = max(r["relative_error"] for r in records)
    ok = all(r["applied"] for r in records) and error <= FP32_RTOL
    figure = f"max rel. error vs large batch over ranks {error:.2e} {'<=' if ok else '>'} {FP32_RTOL:.0e}"
    return CheckResult(name, "pass" if ok else "fail", figure, f"{backend}, {WORLD_SIZE} processes",
                       time.perf_counter() - start)  # fmt: skip
