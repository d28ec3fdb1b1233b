"""The accumulation buffer on the GPU vs in host memory (`offload_accumulation_buffer=True`), against stock
accumulation in `.grad`: time, GPU memory, exactness, and the largest model that trains under a fixed memory cap.

Three arms, each in its own process (this script re-invoked with `--worker`, printing one `BENCH_RESULT` JSON line):

- `stock`: plain PyTorch accumulation, `(loss / GA).backward()` into the parameters' own `.grad` (bf16 for a bf16
  model: rounded at every micro-batch);
- `device`: `GradientAccumulator` with its fp32 buffer on the GPU (4 bytes per parameter);
- `offload`: `GradientAccumulator(offload_accumulation_buffer=True)`, the fp32 buffer in pinned host memory.

What each reports, on a GPT-2-shaped causal LM (random init, `--dtype` parameters, AdamW, micro-batch x GA):

1. **time**: seconds per optimizer step (one window), the median of `--steps` timed windows after one warmup window,
   with `torch.cuda.synchronize()` before each clock read;
2. **GPU gradient bytes held between micro-batches**: `torch.cuda.memory_allocated()` after a micro-batch's backward
   minus the same reading taken before the accumulator (or stock's first `.grad`) existed; the offload arm's is
   0 plus whatever is still in flight, the device arm's its fp32 buffer, stock's its `.grad`s;
3. **peak GPU memory** of the run (`max_memory_allocated`), which includes the window-end step;
4. **exactness**: the first window's mean gradient, device vs offload, relative error (fp32 parameters for this
   comparison, so the figure is the buffers' and not bf16 rounding);
5. **the largest model** (number of transformer layers at `--hidden`) whose training steps fit under
   `--cap_gib` of GPU memory (`torch.cuda.set_per_process_memory_fraction`), found by bisection inside each arm's
   process: each trial builds a fresh model, runs two windows of 2 micro-batches of one 128-token row (so AdamW's
   state exists during a backward, and the weights, gradients and optimizer state dominate the activations) and is
   stopped by a real CUDA out-of-memory error or not. CUDA only.

Command (one H100: about 2 minutes, most of it process start-up):

    python benchmarks/bench_offload.py --device cuda --out docs/gpu/offload.json

On CPU (`--device cpu --tiny`, used by tests/test_bench_offload.py) the same arms run on a tiny model and the
largest-model search is skipped: there is no memory cap to set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH_RESULT "
ARMS = ("stock", "device", "offload")
SAME_UPDATE_RTOL = 1e-6
SLOWDOWN_GOAL = 1.3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="Where the model trains.")
    parser.add_argument("--tiny", action="store_true", help="Tiny shapes, for a CPU smoke run.")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="Parameter dtype.")
    parser.add_argument("--layers", type=int, default=24, help="Transformer layers of the timed model.")
    parser.add_argument("--hidden", type=int, default=1024, help="Hidden size (heads: hidden / 64).")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--ga", type=int, default=8, help="Gradient accumulation steps.")
    parser.add_argument("--steps", type=int, default=3, help="Timed windows after one warmup window.")
    parser.add_argument("--cap_gib", type=float, default=6.0, help="GPU memory cap for the largest-model search.")
    parser.add_argument("--max_layers", type=int, default=96, help="Upper end of the largest-model search.")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"Comma-separated subset of {ARMS}.")
    parser.add_argument("--timeout", type=int, default=180, help="Seconds per worker process.")
    parser.add_argument(
        "--cpu_threads",
        type=int,
        default=None,
        help="torch threads per worker (default: torch's own); 1 keeps CPU timings steady on a shared machine",
    )
    parser.add_argument("--out", type=Path, default=None, help="Write the results here (.json, and .md beside it).")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.seq_len, args.micro_batch, args.ga, args.steps = 2, 64, 32, 2, 4, 2
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}.")
    return args


# ---------------------------------------------------------------------------------------------------- worker side
def _model(args: argparse.Namespace, layers: int, dtype: Any, device: Any) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = 1000 if args.tiny else 50257
    config = GPT2Config(
        n_embd=args.hidden,
        n_layer=layers,
        n_head=max(1, args.hidden // 64),
        n_positions=args.seq_len,
        vocab_size=vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    return model.to(dtype)


def _batches(args: argparse.Namespace, vocab: int, device: Any, count: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=g)
        batches.append(ids.to(device))
    return batches


class _Arm:
    """One arm's training loop: micro-batches of one window, then the step."""

    def __init__(self, arm: str, model: Any, ga: int) -> None:
        import torch

        from hf_gradaccum import GradientAccumulator

        self.arm, self.model, self.ga = arm, model, ga
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.acc = None
        if arm != "stock":
            self.acc = GradientAccumulator(model, ga, offload_accumulation_buffer=arm == "offload")

    def micro_batch(self, ids: Any) -> None:
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.acc is None:
            (loss / self.ga).backward()
        else:
            self.acc.backward(loss, num_items=ids.numel())  # equal items per row: the mean over tokens is exact

    def finish(self) -> None:
        if self.acc is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.acc.step(self.optimizer)

    def mean_gradient(self) -> Any:
        """The window's mean gradient as stepped (call instead of `finish`), flattened in fp32."""
        import torch

        if self.acc is not None:
            self.acc.finish_window()
        return torch.cat([p.grad.detach().float().flatten().cpu() for p in self.model.parameters()])


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_run(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    import torch

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = _model(args, args.layers, dtype, device)
    batches = _batches(args, model.config.vocab_size, device, args.ga)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    runner = _Arm(arm, model, args.ga)
    held: list[int] = []
    times: list[float] = []
    for window in range(1 + args.steps):
        _sync(device)
        start = time.perf_counter()
        for ids in batches:
            runner.micro_batch(ids)
            if window == 1 and cuda:
                _sync(device)
                held.append(torch.cuda.memory_allocated(device) - before)
        runner.finish()
        _sync(device)
        if window > 0:
            times.append(time.perf_counter() - start)
        if window == 0 and cuda:
            # From the first step on, AdamW's state is part of the baseline, not of the gradients.
            before = torch.cuda.memory_allocated(device) - _buffer_bytes_on(runner, device)
    params = sum(p.numel() for p in model.parameters())
    return {
        "arm": arm,
        "parameters": params,
        "seconds_per_step": statistics.median(times),
        "tokens_per_s": args.micro_batch * args.seq_len * args.ga / statistics.median(times),
        "grad_bytes_held_max": max(held) if held else None,
        "grad_bytes_per_parameter": (max(held) / params) if held else None,
        "peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
    }


def _buffer_bytes_on(runner: _Arm, device: Any) -> int:
    """Bytes of the accumulator's buffers that live on `device` (they exist from construction on)."""
    if runner.acc is None:
        return 0
    return sum(b.numel() * b.element_size() for b in runner.acc.buffers.flat.values() if b.device == device)


def _gradient_run(args: argparse.Namespace, arm: str, path: str) -> dict[str, Any]:
    import torch

    device = torch.device(args.device)
    model = _model(args, min(args.layers, 4), torch.float32, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    runner = _Arm(arm, model, args.ga)
    for ids in _batches(args, model.config.vocab_size, device, args.ga):
        runner.micro_batch(ids)
    torch.save(runner.mean_gradient(), path)
    return {"gradient_file": path}


def _largest_model(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    import gc

    import torch

    device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction API needs an index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    dtype = getattr(torch, args.dtype)
    trials: list[tuple[int, bool]] = []
    # One row of 128 tokens: the weights, gradients and optimizer state dominate, not the activations.
    args = argparse.Namespace(**{**vars(args), "micro_batch": 1, "seq_len": 128})

    def fits(layers: int) -> bool:
        model = runner = None
        try:
            model = _model(args, layers, dtype, device)
            runner = _Arm(arm, model, 2)
            for k, ids in enumerate(_batches(args, model.config.vocab_size, device, 4)):  # two windows of 2
                runner.micro_batch(ids)
                if k % 2 == 1:
                    runner.finish()
            torch.cuda.synchronize(device)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            if runner is not None and runner.acc is not None:
                runner.acc.remove_hooks()
            del model, runner
            gc.collect()
            torch.cuda.empty_cache()
        trials.append((layers, ok))
        return ok

    low, high = 0, args.max_layers + 1  # low fits (0: nothing tried), high does not
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return {"arm": arm, "cap_gib": args.cap_gib, "largest_layers": low, "trials": trials}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    task = json.loads(args.worker)
    kind, arm = task["kind"], task["arm"]
    if args.cpu_threads is not None:
        import torch

        torch.set_num_threads(args.cpu_threads)
    if kind == "time":
        result = _timed_run(args, arm)
        if task.get("path"):  # the exactness check, in the same process (after the timed run's peak was read)
            result.update(_gradient_run(args, arm, task["path"]))
        return result
    return _largest_model(args, arm)


# ---------------------------------------------------------------------------------------------------- parent side
def run_worker(args: argparse.Namespace, task: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    command = [sys.executable, __file__, *argv, "--worker", json.dumps(task)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**task, "status": "timeout", "error": f"no result within {args.timeout} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return {**task, "status": "ok", **json.loads(line[len(RESULT_PREFIX) :])}
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {**task, "status": "failed", "error": lines[-1] if lines else f"exit code {done.returncode}"}


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def summarize(args: argparse.Namespace, results: list[dict[str, Any]], comparison: dict[str, Any]) -> str:
    timed = {r["arm"]: r for r in results if r["kind"] == "time"}
    lines = [
        f"GPT-2-shaped, {args.layers} layers, hidden {args.hidden}, {args.dtype} parameters, micro-batch "
        f"{args.micro_batch} x GA {args.ga}, sequence {args.seq_len}, AdamW; device {args.device}.",
        "",
        "| arm | status | s / step | tokens/s | GPU gradient bytes held / parameter | peak allocated (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for arm, r in timed.items():
        lines.append(
            f"| {arm} | {r['status']} | {_fmt(r.get('seconds_per_step'), '.3f')} | {_fmt(r.get('tokens_per_s'), '.0f')}"
            f" | {_fmt(r.get('grad_bytes_per_parameter'), '.3f')} | {_fmt(r.get('peak_allocated_mb'), '.0f')} |"
        )
    lines += ["", *[f"- {key}: {value}" for key, value in comparison.items()]]
    largest = [r for r in results if r["kind"] == "largest"]
    if largest:
        lines += ["", f"Largest model under a {args.cap_gib} GiB cap (layers at hidden {args.hidden}):", ""]
        lines += ["| arm | status | largest layers that train | trials (layers, fits) |", "|---|---|---|---|"]
        for r in largest:
            lines.append(f"| {r['arm']} | {r['status']} | {r.get('largest_layers', '—')} | {r.get('trials', '—')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        print(RESULT_PREFIX + json.dumps(worker(args)), flush=True)
        return 0
    arms = args.arms.split(",")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            path = str(Path(tmp) / f"{arm}.pt") if arm != "stock" else None
            results.append(run_worker(args, {"kind": "time", "arm": arm, "path": path}, argv))
        comparison = compare(results, args)
    if args.device == "cuda":
        for arm in arms:
            results.append(run_worker(args, {"kind": "largest", "arm": arm}, argv))
    table = summarize(args, results, comparison)
    print(table)
    failed = [r for r in results if r["status"] != "ok"]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"arguments": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results,
                  "comparison": comparison, "versions": _versions()}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=2, default=str))
        args.out.with_suffix(".md").write_text(table + "\n")
    return 1 if failed or not comparison.get("offload_equals_device_buffer", True) else 0


def compare(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Offload vs device buffer: the same mean gradient (<= 1e-6 relative) and the time ratio."""
    import torch

    out: dict[str, Any] = {}
    files = {r["arm"]: r.get("gradient_file") for r in results if r["kind"] == "time" and r["status"] == "ok"}
    if files.get("device") and files.get("offload"):
        device, offload = torch.load(files["device"]), torch.load(files["offload"])
        error = float((offload.double() - device.double()).norm() / device.double().norm())
        out["offload_vs_device_relative_gradient_error"] = error
        out["offload_equals_device_buffer"] = error <= SAME_UPDATE_RTOL
    timed = {r["arm"]: r for r in results if r["kind"] == "time" and r["status"] == "ok"}
    if "offload" in timed and "device" in timed:
        ratio = timed["offload"]["seconds_per_step"] / timed["device"]["seconds_per_step"]
        out["offload_time_vs_device"] = round(ratio, 3)
        out[f"offload_time_goal_<=_{SLOWDOWN_GOAL}"] = ratio <= SLOWDOWN_GOAL
    if "offload" in timed and "stock" in timed:
        out["offload_time_vs_stock"] = round(
            timed["offload"]["seconds_per_step"] / timed["stock"]["seconds_per_step"], 3
        )
    return out


def _versions() -> dict[str, str]:
    import platform

    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


if __name__ == "__main__":
    sys.exit(main())
