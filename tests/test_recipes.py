"""The recipes end to end on their tiny configs, as a user runs them (a subprocess per recipe, which itself starts
one subprocess per arm): a valid report, non-empty plots, the saved model, and the parity claims themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.reporting import REPORT_FILES, load_parity_report

ROOT = Path(__file__).resolve().parents[1]
# The subprocess is killed past this hard limit so a hung recipe cannot hang the suite. No test asserts a wall-clock
# time (a loaded CI machine would fail at random); recipe timings live in benchmarks/ and docs/measurements.md.
HARD_LIMIT_S = 600


def run_recipe(
    name: str, config: str, output_dir: Path, *, timeout: int = HARD_LIMIT_S, single_thread: bool = True
) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "recipes" / name), "--config", str(ROOT / "configs" / config)]
    command += ["--output_dir", str(output_dir)]
    env = dict(os.environ)
    if single_thread:
        # One intra-op thread per process: tiny models gain nothing from more, and on a shared 2-core machine
        # OpenMP threads that wait for each other at every op make a loaded run many times slower.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_tiny")
    return out, run_recipe("finetune_bert.py", "finetune_bert_tiny.yaml", out)


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resnet_tiny")
    return out, run_recipe("finetune_resnet.py", "finetune_resnet_tiny.yaml", out)


def arms_by_name(out: Path) -> dict:
    return {arm["name"]: arm for arm in load_parity_report(out / "parity_report.json")["arms"]}


def check_report_files(out: Path) -> None:
    for name in REPORT_FILES.values():
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    for png in ("loss_curves.png", "memory.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The accumulated arm's model, loadable with from_pretrained.
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    # Per-arm weights are deleted once compared (keep_arm_outputs: false).
    assert not list((out / "arms").glob("*/weights.safetensors"))


# ---------------------------------------------------------------------------------------------------- BERT
def test_bert_tiny_report_is_complete(bert_run):
    out, proc = bert_run
    check_report_files(out)
    arms = arms_by_name(out)
    assert list(arms) == ["reference", "accumulated", "small_batch"]
    assert all(arm["status"] == "ok" for arm in arms.values())
    assert (arms["reference"]["micro_batch_size"], arms["reference"]["gradient_accumulation_steps"]) == (16, 1)
    assert (arms["accumulated"]["micro_batch_size"], arms["accumulated"]["gradient_accumulation_steps"]) == (4, 4)
    assert (arms["small_batch"]["micro_batch_size"], arms["small_batch"]["gradient_accumulation_steps"]) == (4, 1)
    for arm in arms.values():
        assert 0.0 <= arm["eval_metrics"]["eval_accuracy"] <= 1.0
        assert arm["peak_memory_mb"] > 0 and arm["fits_memory_limit"] is True
    markdown = (out / "parity_report.md").read_text()
    assert "| accumulated | 4 x 4 = 16 |" in markdown
    assert "accumulated: matches the large batch" in markdown
    assert "Parity report: finetune_bert" in proc.stdout  # the one-screen summary


def test_bert_tiny_accumulated_matches_reference_per_step(bert_run):
    out, _ = bert_run
    arms = arms_by_name(out)
    reference, accumulated = arms["reference"], arms["accumulated"]
    assert accumulated["optimizer_steps"] == reference["optimizer_steps"] == 8  # 64 samples / 16 x 2 epochs
    assert len(accumulated["train_loss"]) == len(reference["train_loss"]) == 8
    for step, (a, r) in enumerate(zip(accumulated["train_loss"], reference["train_loss"], strict=True)):
        assert abs(a - r) <= 1e-4, f"step {step + 1}: accumulated {a} vs reference {r}"
    assert accumulated["matches_reference"] is True and accumulated["loss_diff_basis"] == "per_step"
    assert accumulated["weight_distance"] < 1e-4
    # Same weights -> same predictions.
    assert accumulated["eval_metrics"]["eval_accuracy"] == reference["eval_metrics"]["eval_accuracy"]


def test_bert_tiny_small_batch_is_a_different_run(bert_run):
    out, _ = bert_run
    small = arms_by_name(out)["small_batch"]
    assert small["optimizer_steps"] == 32
    assert small["loss_diff_basis"] == "equal_samples" and small["matches_reference"] is False
    assert small["weight_distance"] > 1e-4


# ---------------------------------------------------------------------------------------------------- ResNet
def test_resnet_tiny_report_is_complete(resnet_run):
    out, proc = resnet_run
    check_report_files(out)
    arms = arms_by_name(out)
    assert set(arms) == {
        "reference",
        "accumulated",
        "small_batch",
        "reference_groupnorm",
        "accumulated_groupnorm",
        "accumulated_momentum",
    }
    assert all(arm["status"] == "ok" for arm in arms.values())
    assert "Parity report: finetune_resnet" in proc.stdout


def test_resnet_tiny_groupnorm_is_exact_and_batchnorm_is_not(resnet_run):
    out, _ = resnet_run
    arms = arms_by_name(out)
    groupnorm = arms["accumulated_groupnorm"]
    assert groupnorm["compared_to"] == "reference_groupnorm"
    assert groupnorm["batchnorm_layers"] == 0
    assert groupnorm["matches_reference"] is True and groupnorm["max_abs_loss_diff"] <= 1e-4
    # BatchNorm over micro-batches of 8 instead of the batch of 32: a different forward pass, not a rounding error.
    for name in ("accumulated", "accumulated_momentum"):
        arm = arms[name]
        assert arm["compared_to"] == "reference" and arm["batchnorm_layers"] > 0
        assert arm["matches_reference"] is False and arm["max_abs_loss_diff"] > 1e-3
        assert "BatchNorm layers normalise over micro-batches of 8" in arm["verdict"]
    # The first step sees the same initial weights, so only BatchNorm can explain the gap.
    assert arms["accumulated"]["train_loss"][0] != pytest.approx(arms["reference"]["train_loss"][0], abs=1e-4)


def test_split_invariance_check_predicts_the_arms(bert_run, resnet_run):
    """Issue 10: every arm checks its first window before training; the verdicts are in the report."""
    bert = load_parity_report(bert_run[0] / "parity_report.json")["accumulation_check"]
    assert set(bert) == {"reference", "accumulated", "small_batch"}
    assert all(v["passed"] and v["max_rel_diff"] <= 1e-5 for v in bert.values()), bert
    resnet = load_parity_report(resnet_run[0] / "parity_report.json")["accumulation_check"]
    for name in ("reference_groupnorm", "accumulated_groupnorm"):
        assert resnet[name]["passed"], resnet[name]
    # The BatchNorm arms are flagged, with the cause, before they train and miss the reference.
    for name in ("reference", "accumulated", "small_batch", "accumulated_momentum"):
        assert not resnet[name]["passed"] and resnet[name]["causes"] == ["batchnorm"], resnet[name]
    assert "Split-invariance check" in (resnet_run[0] / "parity_report.md").read_text()


# ---------------------------------------------------------------------------------------------------- slow
def _write_csv_dataset(folder: Path, rows: int) -> None:
    """A `datasets` folder with train/validation CSVs under other column names: the Hub code path, offline."""
    import datasets

    from hf_gradaccum.assets import locate_asset

    data = datasets.load_dataset("csv", data_files=str(locate_asset("rotten_tomatoes")), split="train")
    data = data.filter(lambda row: row["category"] in ("fresh", "rotten")).select(range(2 * rows))
    frame = data.to_pandas()
    frame = frame.assign(sentence=frame["text"], polarity=(frame["category"] == "fresh").astype(int))
    folder.mkdir(parents=True)
    frame[["sentence", "polarity"]][:rows].to_csv(folder / "train.csv", index=False)
    frame[["sentence", "polarity"]][rows:].to_csv(folder / "validation.csv", index=False)


@pytest.mark.slow
def test_bert_hub_code_path_with_local_dataset_and_model(tmp_path):
    """`dataset_name` / `model_name_or_path` / column options, exercised with local folders instead of the Hub."""
    from hf_gradaccum.assets import locate_asset

    _write_csv_dataset(tmp_path / "polarity", rows=32)
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "recipes" / "finetune_bert.py")]
    command += ["--config", str(ROOT / "configs" / "finetune_bert_tiny.yaml"), "--output_dir", str(out)]
    command += ["--dataset_name", str(tmp_path / "polarity"), "--text_column", "sentence"]
    command += ["--label_column", "polarity", "--model_name_or_path", str(locate_asset("minilm"))]
    command += ["--arms", "reference", "accumulated", "--num_train_epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=HARD_LIMIT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    arms = arms_by_name(out)
    assert arms["accumulated"]["matches_reference"] is True
    assert load_parity_report(out / "parity_report.json")["train_samples"] == 32


@pytest.mark.slow
def test_resnet_hub_code_path_with_local_imagefolder(tmp_path):
    """An image-folder dataset (PIL images, ClassLabel labels) through `dataset_name`, GroupNorm arms exact."""
    import numpy as np
    from PIL import Image

    from hf_gradaccum.assets import locate_asset

    # The file is sorted by class (500 rows each): every 50th row gives 10 of each digit. With a single class
    # `datasets` would infer no label column at all.
    table = np.loadtxt(locate_asset("mnist_5k"), delimiter=",")[::50][:96]
    for i, row in enumerate(table):
        split = "train" if i < 64 else "test"
        folder = tmp_path / "digits" / split / f"digit{int(row[-1])}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(row[:-1].reshape(28, 28).astype(np.uint8), mode="L").save(folder / f"{i}.png")
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "recipes" / "finetune_resnet.py")]
    command += ["--config", str(ROOT / "configs" / "finetune_resnet_tiny.yaml"), "--output_dir", str(out)]
    command += ["--dataset_name", str(tmp_path / "digits"), "--max_train_samples", "64", "--max_eval_samples", "32"]
    command += ["--arms", "reference_groupnorm", "accumulated_groupnorm", "--num_train_epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=HARD_LIMIT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert arms_by_name(out)["accumulated_groupnorm"]["matches_reference"] is True


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["finetune_bert", "finetune_resnet"])
def test_default_recipe(recipe, tmp_path):
    """The default configuration (minutes on a CPU): learns, matches, and the accumulated arm needs less memory."""
    # The defaults take minutes on a CPU (timings in docs/measurements.md); run as a user runs them (all cores).
    run_recipe(f"{recipe}.py", f"{recipe}.yaml", tmp_path, timeout=20 * 60, single_thread=False)
    arms = arms_by_name(tmp_path)
    report = load_parity_report(tmp_path / "parity_report.json")
    assert arms["reference"]["eval_metrics"]["eval_accuracy"] > report["majority_class_accuracy"] + 0.1
    assert arms["accumulated"]["peak_memory_mb"] < arms["reference"]["peak_memory_mb"]
    if recipe == "finetune_bert":
        assert arms["accumulated"]["matches_reference"] is True  # per step within 1e-4, all 64 steps
        assert (
            abs(
                arms["accumulated"]["eval_metrics"]["eval_accuracy"]
                - arms["reference"]["eval_metrics"]["eval_accuracy"]
            )
            <= 0.005
        )
        return
    # ResNet (ReLU, from scratch): the exact arms agree at step 1 and then drift only as far as the large batch
    # drifts from itself under a 1e-7 weight perturbation; BatchNorm arms already differ at step 1.
    for name in ("accumulated_groupnorm", "accumulated_freeze"):
        assert arms[name]["first_step_loss_diff"] <= 1e-4, name
        assert arms[name]["within_noise_floor"] is True, arms[name]["verdict"]
    for name in ("accumulated", "accumulated_momentum"):
        assert arms[name]["first_step_loss_diff"] > 1e-3 and arms[name]["within_noise_floor"] is False, name
