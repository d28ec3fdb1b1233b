#!/usr/bin/env python
"""Time per optimizer step of a sentence-transformers loss that is a mean over rows, composed with `GradAccumTrainer`,
by the route it takes (`item_mean`: plain accumulation weighted by rows) against the coupled mode it took before
(forced with `register_sentence_transformers_loss(loss, "coupled")`), and against the stock trainer accumulating the
same loss; each configuration in its own process, alternating, the ratios within one run.

Model: a random-init 2-layer BERT `SentenceTransformer` (mean pooling) of `--hidden`, the word-level test tokenizer;
data: (anchor, positive) pairs with a float score; SGD; `--batch` rows per micro-batch, `--steps` micro-batches per
optimizer step. Time: the median of the process CPU time between consecutive optimizer steps (the first excluded).

    python benchmarks/bench_st_routes.py --loss cosine_similarity --hidden 256 --batch 16 --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGURATIONS = ("stock", "item_mean", "coupled")
LOSSES = ("cosine_similarity", "contrastive")


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Train `--optimizer_steps` steps of one configuration in this process and time them."""
    import torch
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses
    from transformers import TrainerCallback

    from hf_gradaccum import GradAccumTrainer
    from hf_gradaccum.integrations.sentence_transformers.routing import register_sentence_transformers_loss
    from tests.st_cases import pairs, st_args, tiny_sentence_transformer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    loss_cls = {"cosine_similarity": losses.CosineSimilarityLoss, "contrastive": losses.ContrastiveLoss}[args.loss]
    if args.only == "coupled":
        register_sentence_transformers_loss(loss_cls, "coupled")

    class Composed(GradAccumTrainer, SentenceTransformerTrainer):
        pass

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.cpu: list[float] = []

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.cpu.append(time.process_time())

    folder = Path(tempfile.mkdtemp(prefix="bench_st_routes_"))
    model = tiny_sentence_transformer(folder, hidden=args.hidden)
    data = pairs(args.batch * args.steps * args.optimizer_steps, labels=True)
    if args.loss == "contrastive":
        data = data.map(lambda row: {"label": float(row["label"] > 0.5)})
    clock = Clock()
    trainer_cls = SentenceTransformerTrainer if args.only == "stock" else Composed
    trainer = trainer_cls(
        model=model,
        args=st_args(folder, args.batch, args.steps, max_steps=args.optimizer_steps, learning_rate=1e-3),
        train_dataset=data,
        loss=loss_cls(model),
        callbacks=[clock],
    )
    trainer.train()
    steps = [b - a for a, b in zip(clock.cpu[:-1], clock.cpu[1:], strict=True)]
    return {
        "configuration": args.only,
        "route": getattr(trainer, "_st_route", None),
        "cpu_seconds_per_step": statistics.median(steps),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", choices=LOSSES, default="cosine_similarity")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--optimizer_steps", type=int, default=6, help="optimizer steps per run (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration, alternating order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--only", choices=CONFIGURATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.optimizer_steps < 3:
        parser.error("--optimizer_steps must be >= 3 (the first step is not timed)")
    if args.only:
        print(json.dumps(run_one(args)))
        return
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGURATIONS}
    argv = sys.argv[1:] if argv is None else argv
    for round_index in range(args.rounds):
        order = CONFIGURATIONS if round_index % 2 == 0 else CONFIGURATIONS[::-1]
        for name in order:
            done = subprocess.run(
                [sys.executable, __file__, *argv, "--only", name], capture_output=True, text=True, check=True
            )
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"{args.loss}, hidden {args.hidden}, {args.batch} x {args.steps}, {args.threads} thread(s), "
        f"{args.rounds} round(s)\n"
        "| configuration | route | CPU s / step (median of the runs) | vs stock |\n|---|---|---:|---:|"
    )
    stock = statistics.median(r["cpu_seconds_per_step"] for r in runs["stock"])
    for name in CONFIGURATIONS:
        seconds = statistics.median(r["cpu_seconds_per_step"] for r in runs[name])
        print(f"| {name} | {runs[name][0]['route'] or '-'} | {seconds:.4f} | {seconds / stock:.2f} |")


if __name__ == "__main__":
    main()
