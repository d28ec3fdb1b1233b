"""Memory per rank: DDP vs FSDP2 (both reduce schedules), with `GradientAccumulator` and AdamW, 2 and 4 processes.

Run from the repository root (gloo on CPU; each configuration is its own `torchrun` launch, so every process is
fresh and its peak RSS belongs to that configuration alone):

    python benchmarks/bench_fsdp_memory.py

Methods:

* `ddp`: `DistributedDataParallel` (`no_sync` on every micro-batch), the accumulator's flat fp32 buffer of the whole
  model, one all-reduce per window: every rank holds the whole model, buffer and optimizer state.
* `fsdp2_every_micro_batch`: `fully_shard` on every `BertLayer` and the root; FSDP2 reduce-scatters each micro-batch
  into the accumulator's *sharded* fp32 buffer.
* `fsdp2_once_per_window`: the same model with `fsdp_reduce_schedule="once_per_window"`: FSDP2 keeps the unsharded
  gradient between micro-batches (one full-model fp32 gradient per rank) and reduce-scatters once per window.

Measured per rank (the largest over ranks is reported; every rank is in the JSON): bytes of the rank-local storage of
the parameters, of the accumulation buffer, of FSDP2's unsharded accumulated gradients after a no-sync micro-batch
(`once_per_window` only), and of AdamW's state (after the first step); the process's peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`), also minus the peak RSS just before the model was built (imports,
allocator, gloo); and the median seconds per optimizer step. The expectation for FSDP2 is the DDP figure divided by
the world size.

Model: `BertForSequenceClassification`, random init (`--hidden`, `--layers`, vocab 30522: the embedding table is most
of the parameters, as in real BERT), micro-batches of `--micro` x `--seq_len` synthetic tokens per rank.

Writes `benchmarks/results/fsdp_memory.{json,md}` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
METHODS = ("ddp", "fsdp2_every_micro_batch", "fsdp2_once_per_window")
MB = 2**20


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their rank-local tensor)."""
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    """Resident set size now (Linux `/proc/self/statm`): what the process still holds after the peak."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(method: str, args: argparse.Namespace):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import BertConfig, BertForSequenceClassification

    from hf_gradaccum import GradientAccumulator

    config = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max(128, args.seq_len),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    if method == "ddp":
        model = DistributedDataParallel(model, broadcast_buffers=False)
        schedule = "every_micro_batch"
    else:
        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        schedule = method.removeprefix("fsdp2_")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accumulator = GradientAccumulator(model, args.steps, fsdp_reduce_schedule=schedule)
    return model, optimizer, accumulator


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration (under `torchrun`): train `--windows` windows, write this rank's figures."""
    import torch.distributed as dist
    import transformers  # noqa: F401  (imported before the baseline RSS is read, so it does not count as growth)

    import hf_gradaccum  # noqa: F401

    torch.set_num_threads(1)  # one rank per core at most: more threads would only fight over the shared cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_before_model = peak_rss_bytes()
    model, optimizer, accumulator = build(args.method, args)
    rss_after_build = current_rss_bytes()
    g = torch.Generator().manual_seed(1000 + rank)
    times, unsharded_grad_bytes = [], 0
    for window in range(args.windows + 1):
        dist.barrier()
        start = time.perf_counter()
        for k in range(args.steps):
            batch = {
                "input_ids": torch.randint(1000, 30522, (args.micro, args.seq_len), generator=g),
                "attention_mask": torch.ones(args.micro, args.seq_len, dtype=torch.long),
                "labels": torch.randint(0, 2, (args.micro,), generator=g),
            }
            with accumulator.accumulate(model) if args.method == "ddp" else contextlib.nullcontext():
                accumulator.backward(model(**batch).loss, num_items=args.micro)
            if k == 0 and args.method == "fsdp2_once_per_window":
                unsharded_grad_bytes = max(unsharded_grad_bytes, accumulator.fsdp_schedule.unsharded_gradient_bytes())
        accumulator.step(optimizer, max_grad_norm=1.0)
        dist.barrier()
        if window > 0:  # the first window warms up allocators and gloo, and creates AdamW's state
            times.append(time.perf_counter() - start)
    state_tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    record = {
        "rank": rank,
        "world_size": world,
        "method": args.method,
        "param_bytes": storage_bytes(accumulator.parameters),
        "buffer_bytes": sum(b.untyped_storage().nbytes() for b in accumulator.buffers.flat.values()),
        "fsdp_unsharded_grad_bytes": unsharded_grad_bytes,
        "optimizer_state_bytes": storage_bytes(state_tensors),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_rss_before_model_bytes": rss_before_model,
        "rss_after_build_bytes": rss_after_build,
        "rss_at_end_bytes": current_rss_bytes(),
        "s_per_step": statistics.median(times),
        "per_window_s": times,
        "trainable_params": sum(p.numel() for p in model.parameters()),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def launch(method: str, world: int, args: argparse.Namespace, out: str) -> list[dict]:
    """One fresh `torchrun` launch of `world` processes; returns every rank's record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += [__file__, "--worker", "--method", method, "--out", out]
    cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "windows", "micro", "seq_len", "hidden", "layers")]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    if args.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def summarize(records: list[dict]) -> dict:
    """The largest figure over ranks (ranks differ only by dim-0 padding of the last shards)."""
    keys = ("param_bytes", "buffer_bytes", "fsdp_unsharded_grad_bytes", "optimizer_state_bytes", "peak_rss_bytes")
    keys += ("rss_at_end_bytes",)
    row = {k: max(r[k] for r in records) for k in keys}
    row["rss_growth_bytes"] = max(r["peak_rss_bytes"] - r["peak_rss_before_model_bytes"] for r in records)
    row["rss_training_growth_bytes"] = max(r["peak_rss_bytes"] - r["rss_after_build_bytes"] for r in records)
    row["state_bytes"] = row["param_bytes"] + row["buffer_bytes"] + row["optimizer_state_bytes"]
    row["s_per_step"] = max(r["s_per_step"] for r in records)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| processes | method | params MiB | accumulation buffer MiB | FSDP2 unsharded grads MiB (mid-window) "
        "| AdamW state MiB | params + buffer + state MiB | DDP / world MiB | ratio to DDP / world "
        "| peak RSS MiB | peak RSS growth from model build MiB | of which in training MiB | RSS at end MiB "
        "| s / optimizer step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world_size']} | {r['method']} | {r['param_bytes'] / MB:.1f} | {r['buffer_bytes'] / MB:.1f} "
            f"| {r['fsdp_unsharded_grad_bytes'] / MB:.1f} | {r['optimizer_state_bytes'] / MB:.1f} "
            f"| {r['state_bytes'] / MB:.1f} | {r['ddp_per_world_bytes'] / MB:.1f} | {r['ratio_to_ddp_per_world']:.2f} "
            f"| {r['peak_rss_bytes'] / MB:.0f} | {r['rss_growth_bytes'] / MB:.0f} "
            f"| {r['rss_training_growth_bytes'] / MB:.0f} | {r['rss_at_end_bytes'] / MB:.0f} "
            f"| {r['s_per_step']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[2, 4], help="Processes per launch.")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=4, help="Micro-batches per optimizer step.")
    parser.add_argument("--windows", type=int, default=3, help="Timed optimizer steps (after 1 warm-up).")
    parser.add_argument("--micro", type=int, default=4, help="Micro-batch size per rank.")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--malloc_arena_max",
        type=int,
        default=0,
        help="Set glibc's MALLOC_ARENA_MAX for the launched processes (0: leave the allocator as it is). gloo's and "
        "FSDP2's threads allocate from their own arenas, which inflates and slowly grows RSS; 1 shows the tensors' "
        "memory with less allocator noise.",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="Results file stem under benchmarks/results/ (default: fsdp_memory, or fsdp_memory_arena<N> with "
        "--malloc_arena_max N).",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    configs = [(w, m) for w in args.world_sizes for m in args.methods]
    rows = []
    for i, (world, method) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {method}, {world} processes ...", flush=True)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            records = launch(method, world, args, out)
        row = {"world_size": world, "method": method, **summarize(records), "ranks": records}
        rows.append(row)
        print(
            f"[{i}/{len(configs)}] {method}, {world} processes: params+buffer+state {row['state_bytes'] / MB:.1f} MiB "
            f"per rank, peak RSS {row['peak_rss_bytes'] / MB:.0f} MiB, {row['s_per_step']:.2f} s/step "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    for row in rows:
        ddp = next((r for r in rows if r["method"] == "ddp" and r["world_size"] == row["world_size"]), None)
        row["ddp_per_world_bytes"] = ddp["state_bytes"] / row["world_size"] if ddp else float("nan")
        row["ratio_to_ddp_per_world"] = row["state_bytes"] / row["ddp_per_world_bytes"] if ddp else float("nan")

    params = rows[0]["ranks"][0]["trainable_params"]
    command = "python benchmarks/bench_fsdp_memory.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if k not in ("worker", "method", "out") and v is not None
    )
    meta = {
        "command": command,
        "trainable_params": params,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "backend": "gloo",
        **{k: v for k, v in vars(args).items() if k not in ("worker", "method", "out")},
    }
    text = table(rows)
    header = (
        f"# Memory per rank: DDP vs FSDP2, with GradientAccumulator and AdamW\n\nCommand: `{command}`\n\n"
        f"BERT hidden {args.hidden} x {args.layers} layers, vocab 30522 ({params / 1e6:.1f}M trainable parameters, "
        f"fp32), micro-batch {args.micro} x {args.seq_len} tokens per rank, {args.steps} micro-batches per step, "
        f"AdamW, gloo on CPU, torch {torch.__version__}, {meta['machine']} (shared with other work: times are "
        f"indicative). Each row is a fresh launch; figures are the largest over ranks.\n\n"
        "params + buffer + state: rank-local storage of the parameters, the accumulator's fp32 buffer and AdamW's "
        "state. DDP / world: the DDP row's figure divided by the processes (the ideal for full sharding). FSDP2 "
        "unsharded grads: what `once_per_window` adds between micro-batches (not in the sum; it is freed at the "
        "window's reduce-scatter). Peak RSS growth: peak RSS minus the peak before the model was built (after imports "
        "and `init_process_group`); it includes the full model that every rank builds before `fully_shard` shards it "
        "(no meta-device init here); 'of which in training': peak RSS minus the RSS right after the model, optimizer and "
        "accumulator were built. RSS at end: resident memory after the last step.\n\n"
    )
    if args.malloc_arena_max:
        header += f"glibc allocator: `MALLOC_ARENA_MAX={args.malloc_arena_max}` in every process.\n\n"
    name = args.name or (f"fsdp_memory_arena{args.malloc_arena_max}" if args.malloc_arena_max else "fsdp_memory")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.md").write_text(header + text + "\n")
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
