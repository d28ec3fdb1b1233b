"""The self-test's out-of-memory check: a window trained under a real memory cap with `WindowOOMRetry` shrinks its
micro-batch after real allocation failures and still hands the optimizer the large-batch gradient.

It runs in its own process (`python -m hf_gradaccum.diagnostics.memory_cap DEVICE`), because a cap cannot be lifted
cleanly from a process that has run into it. The cap: an address-space limit (`RLIMIT_AS`) on CPU,
`torch.cuda.set_per_process_memory_fraction` on CUDA; other devices have no cap to set, and the check is skipped.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import torch
from torch import nn

from ..engine.accumulator import GradientAccumulator
from ..engine.oom_retry import WindowOOMRetry
from .checks import FP32_RTOL, CheckResult, relative_error

DIM, ROWS, MICRO_BATCHES = 1024, 32, 2
# Room above the memory in use when the cap is set: each row makes DIM x DIM activations (4 MiB each in fp32), so a
# micro-batch of 32 rows needs several hundred MiB and one of 8 rows fits.
HEADROOM_MB = 150


class OuterProductNet(nn.Module):
    """Activation memory grows with the rows of a micro-batch much faster than the weights: a real allocation
    failure is reached quickly under a small cap."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.head(torch.tanh(h[:, :, None] * h[:, None, :]).mean(dim=2))


def _cap_memory(device: torch.device) -> str:
    if device.type == "cpu":
        import resource

        vm_kib = int(re.search(r"VmSize:\s+(\d+)", open("/proc/self/status").read()).group(1))
        limit = vm_kib * 1024 + HEADROOM_MB * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        return f"RLIMIT_AS {limit / 2**20:.0f} MiB (in use + {HEADROOM_MB} MiB)"
    if device.index is None:  # the CUDA memory APIs refuse a device without an index
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()  # cached blocks would serve allocations above the cap
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = (torch.cuda.memory_reserved(device) + HEADROOM_MB * 2**20) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return f"set_per_process_memory_fraction({fraction:.4f}) (in use + {HEADROOM_MB} MiB)"


def run_capped_window(device: torch.device) -> dict:
    """In this process: the large-batch gradient uncapped, then the window under the cap; the record to report."""
    torch.set_num_threads(1)  # one thread: no per-thread arenas growing the address space under the cap
    torch.manual_seed(0)
    model = OuterProductNet().to(device)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(ROWS * MICRO_BATCHES, DIM, generator=g) * 0.1).to(device)
    y = torch.randint(0, 4, (ROWS * MICRO_BATCHES,), generator=g).to(device)

    nn.functional.cross_entropy(model(x), y).backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x[:2]), y[:2]).backward()  # warm up the allocator and kernels at 2 rows
    model.zero_grad(set_to_none=True)

    cap = _cap_memory(device)
    accumulator = GradientAccumulator(model, MICRO_BATCHES)
    retry = WindowOOMRetry()
    window = [{"x": x[k * ROWS : (k + 1) * ROWS], "y": y[k * ROWS : (k + 1) * ROWS]} for k in range(MICRO_BATCHES)]

    def micro_step(batch: dict) -> None:
        for chunk in retry.chunks(batch):
            loss = nn.functional.cross_entropy(model(chunk["x"]), chunk["y"])
            accumulator.backward(loss, num_items=len(chunk["y"]))

    for index in range(MICRO_BATCHES):
        retry.run(accumulator, window, index, micro_step)
    result = accumulator.finish_window()
    ours = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
    return {"cap": cap, "applied": result.applied, "chunk_size": retry.chunk_size,
            "relative_error": relative_error(ours, reference)}  # fmt: skip


def check_oom_retry(device: torch.device, timeout: float = 300.0) -> CheckResult:
    """Run the capped window in a fresh process and judge its record."""
    name = "oom-retry/memory-cap"
    if device.type == "cpu" and not sys.platform.startswith("linux"):
        return CheckResult(name, "skip", detail="the CPU cap needs Linux (RLIMIT_AS and /proc)")
    if device.type not in ("cpu", "cuda"):
        return CheckResult(name, "skip", detail=f"no per-process memory cap can be set on {device.type}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", __name__, str(device)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return CheckResult(name, "fail", "the capped window crashed", last, seconds)
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    if record["chunk_size"] is None:
        return CheckResult(name, "skip", detail=f"the cap ({record['cap']}) caused no out-of-memory error here",
                           seconds=seconds)  # fmt: skip
    error = record["relative_error"]
    ok = record["applied"] and error <= FP32_RTOL
    figure = (f"micro-batch {ROWS} -> {record['chunk_size']} rows after real OOMs, rel. error vs large batch "
              f"{error:.2e} {'<=' if ok else '>'} {FP32_RTOL:.0e}")  # fmt: skip
    return CheckResult(name, "pass" if ok else "fail", figure, record["cap"], seconds)


if __name__ == "__main__":
    print(json.dumps(run_capped_window(torch.device(sys.argv[1]))))
