#!/usr/bin/env python
"""sentence-transformers' own `CachedMultipleNegativesRankingLoss` against `GradAccumTrainer`'s automatic coupled
mode, on the same data: update difference against the large batch, step time and peak memory; each configuration in
its own process (so each peak is its own), the ratios within one run.

Model: the offline pretrained MiniLM-L6 (`hf_gradaccum.assets`, dropout off so that the update difference measures
the method, not different dropout masks) as a `SentenceTransformer` (mean pooling); data: Rotten Tomatoes sentences,
each paired with its first half as the positive; `MultipleNegativesRankingLoss(scale=20)`; SGD (lr 1 for the first step, whose update is compared, then 1e-3), one
optimizer step = `--batch * --steps` pairs, rows in dataset order (sequential batch sampler) for every configuration.

- `large_batch`: stock `SentenceTransformerTrainer`, one batch of b x K (the reference);
- `stock_accumulation`: stock trainer, b per micro-batch, GA = K (each micro-batch's own negatives);
- `gradaccum`: `class T(GradAccumTrainer, SentenceTransformerTrainer)`, b per micro-batch, GA = K (coupled mode);
- `cached`: stock trainer, one batch of b x K with `CachedMultipleNegativesRankingLoss(mini_batch_size=b)`.

Update difference: `|u - u_large| / |u_large|` after the first optimizer step. Time: median over steps 2..n, wall
clock and process CPU time (steadier than wall clock on a machine shared with other work; with `--threads 1` it is
the compute itself). Memory:
peak RSS minus RSS before training (`ru_maxrss`), or the CUDA peak.

    python benchmarks/bench_st_cached.py --batch 16 --steps 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("large_batch", "stock_accumulation", "gradaccum", "cached")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pairs(n: int, max_words: int):
    import datasets
    import pandas as pd

    from hf_gradaccum.assets import locate_asset

    frame = pd.read_csv(locate_asset("rotten_tomatoes"))
    texts = frame[frame["category"].isin(["fresh", "rotten"])]["text"].drop_duplicates().tolist()[:n]
    anchors = [" ".join(t.split()[:max_words]) for t in texts]
    positives = [" ".join(a.split()[: max(2, len(a.split()) // 2)]) for a in anchors]
    return datasets.Dataset.from_dict({"anchor": anchors, "positive": positives})


def sequential_batches(dataset, batch_size: int, drop_last: bool, **kwargs):
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from torch.utils.data import SequentialSampler

    return DefaultBatchSampler(
        SequentialSampler(range(len(dataset))), batch_size=batch_size, drop_last=drop_last, **kwargs
    )


def run_one(mode: str, args: argparse.Namespace) -> dict:
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
        losses,
    )
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import TrainerCallback

    from hf_gradaccum import GradAccumTrainer
    from hf_gradaccum.assets import locate_asset

    class GradAccumSentenceTransformerTrainer(GradAccumTrainer, SentenceTransformerTrainer):
        pass

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    transformer = Transformer(
        str(locate_asset("minilm")),
        max_seq_length=args.max_seq_length,
        config_kwargs={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    )
    model = SentenceTransformer(
        modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")], device=args.device
    )
    b, k = args.batch, args.steps
    micro, accumulation = (b * k, 1) if mode in ("large_batch", "cached") else (b, k)
    if mode == "cached":
        loss = losses.CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=b)
    else:
        loss = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    trainer_cls = GradAccumSentenceTransformerTrainer if mode == "gradaccum" else SentenceTransformerTrainer
    train_args = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        max_steps=args.repeats + 1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        batch_sampler=sequential_batches,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=args.device == "cpu",
        disable_tqdm=True,
        seed=0,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    initial = torch.cat([p.detach().flatten().double().cpu() for p in params])
    record: dict = {"times": [], "cpu_times": []}

    class Probe(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            if args.device != "cpu":
                torch.cuda.synchronize()
            record["start"], record["cpu_start"] = time.perf_counter(), time.process_time()

        def on_step_end(self, state_args, state, control, **kw):
            if args.device != "cpu":
                torch.cuda.synchronize()
            record["times"].append(time.perf_counter() - record["start"])
            record["cpu_times"].append(time.process_time() - record["cpu_start"])
            if state.global_step == 1:
                record["update"] = torch.cat([p.detach().flatten().double().cpu() for p in params]) - initial
                # lr 1 makes the first update (the gradient) large against fp32 weight rounding; the timed steps
                # go on at an ordinary learning rate.
                for group in kw["optimizer"].param_groups:
                    group["lr"] = 1e-3
                kw["lr_scheduler"].base_lrs = [1e-3] * len(kw["lr_scheduler"].base_lrs)

    dataset = pairs(b * k * (args.repeats + 1), args.max_words)
    trainer = trainer_cls(model=model, args=train_args, train_dataset=dataset, loss=loss, callbacks=[Probe()])
    if args.device == "cpu":
        base = rss_mib()
    else:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    trainer.train()
    peak = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
        if args.device == "cpu"
        else torch.cuda.max_memory_allocated() / 2**20 - base
    )
    timed, cpu = sorted(record["times"][1:]), sorted(record["cpu_times"][1:])
    torch.save(record["update"], Path(args.out) / f"{mode}.pt")
    return {
        "mode": mode,
        "peak_mib_above_start": peak,
        "seconds_per_step": timed[len(timed) // 2],
        "cpu_seconds_per_step": cpu[len(cpu) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch (b)")
    parser.add_argument("--steps", type=int, default=4, help="accumulation steps (K)")
    parser.add_argument("--max_words", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed optimizer steps (after the first)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run_one(args.only, args)))
        return
    out = tempfile.mkdtemp()
    rows = []
    for mode in args.modes:
        done = subprocess.run(
            [sys.executable, *sys.argv, "--only", mode, "--out", out], capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise SystemExit(f"{mode} failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    reference = torch.load(Path(out) / "large_batch.pt") if "large_batch" in args.modes else None
    by_mode = {r["mode"]: r for r in rows}
    base = by_mode.get("large_batch", rows[0])
    print(
        f"b = {args.batch}, K = {args.steps} (large batch {args.batch * args.steps}), MiniLM-L6, max_seq_length "
        f"{args.max_seq_length}, {args.device}, {args.threads} threads"
    )
    print(
        "| configuration | update difference vs large batch | s / step (median) | CPU s / step (median) "
        "| CPU time vs large batch | peak MiB above start | memory vs large batch |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        diff = "-"
        if reference is not None:
            update = torch.load(Path(out) / f"{r['mode']}.pt")
            diff = f"{float((update - reference).norm() / reference.norm()):.2e}"
        print(
            f"| {r['mode']} | {diff} | {r['seconds_per_step']:.2f} | {r['cpu_seconds_per_step']:.2f} | "
            f"{r['cpu_seconds_per_step'] / base['cpu_seconds_per_step']:.2f} | {r['peak_mib_above_start']:,.0f} | "
            f"{r['peak_mib_above_start'] / max(base['peak_mib_above_start'], 1e-9):.2f} |"
        )


if __name__ == "__main__":
    main()
