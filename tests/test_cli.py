"""`hf-gradaccum verify` smoke tests on a tiny model folder and a csv file (the offline MiniLM default is timed in
docs/verification.md; it takes ~15 s, too slow for the default run)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertForSequenceClassification

from hf_gradaccum.cli import EXIT_CODES, main, verdict_of
from tests.composition_cases import WORDS, tiny_gpt2, word_tokenizer
from tests.parity_cases import tiny_bert_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def csv_file(tmp_path):
    rng = random.Random(0)
    lines = ["text,label"] + [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))) + f",{rng.randint(0, 1)}" for _ in range(40)
    ]
    path = tmp_path / "data.csv"
    path.write_text("\n".join(lines))
    return str(path)


def save(model, path):
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return str(path)


def test_verify_seq_cls_model_folder_passes(tmp_path, csv_file, capsys):
    model = BertForSequenceClassification(tiny_bert_config(num_labels=2))
    folder = save(model, tmp_path / "bert")
    out = tmp_path / "result.json"
    code = main(["verify", "--model", folder, "--dataset", csv_file, "--micro_batch_size", "4",
                 "--gradient_accumulation_steps", "3", "--full_batch", "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "EXACT" in printed and "time:" in printed
    record = json.loads(out.read_text())
    assert record["passed"] and record["splits"]["full"] == [12]


def test_verify_causal_lm_counts_shifted_labels(tmp_path, csv_file, capsys):
    folder = save(tiny_gpt2(), tmp_path / "gpt2")
    code = main(["verify", "--model", folder, "--task", "causal-lm", "--dataset", csv_file,
                 "--micro_batch_size", "2", "--gradient_accumulation_steps", "2"])  # fmt: skip
    assert code == 0, capsys.readouterr().out


def test_verify_batchnorm_resnet_fails_naming_batchnorm(capsys):
    code = main(["verify", "--task", "image-cls", "--micro_batch_size", "4", "--gradient_accumulation_steps", "2"])
    printed = capsys.readouterr().out
    assert (
        code == 1
        and "NOT EXACT" in printed
        and "batchnorm:" in printed
        and "convert_batchnorm_to_groupnorm" in printed
    )


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The console script as a user runs it, in its own process (what it prints and its exit status)."""
    return subprocess.run([sys.executable, "-m", "hf_gradaccum.cli", "verify", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})  # fmt: skip


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one `error:` line naming the argument, no traceback, and nothing loaded (no verdict printed)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and lines[-1].startswith("hf-gradaccum verify: error: "), proc.stderr
    assert all(needle in lines[-1] for needle in needles), lines[-1]
    assert "model:" not in proc.stdout and "split invariance" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--micro_batch_size", "0"], ["--micro_batch_size", "must be an integer >= 1, got 0"]),
        (["--gradient_accumulation_steps", "x"], ["--gradient_accumulation_steps", "got 'x'"]),
        (["--task", "nope"], ["--task", "invalid choice"]),
    ],
)
def test_range_and_type_errors_print_the_subcommand_usage(args, needles):
    proc = run_cli(*args)
    assert_one_line_error(proc, *needles)
    assert proc.stderr.startswith("usage: hf-gradaccum verify "), proc.stderr


def test_nonexistent_model_path_fails_before_loading():
    assert_one_line_error(run_cli("--model", "/nonexistent/model"), "--model /nonexistent/model", "no such folder")


def test_folder_without_a_model_fails_before_loading(tmp_path):
    assert_one_line_error(run_cli("--model", str(tmp_path)), "--model", "no config.json")


def test_hub_id_while_offline_fails_at_once():
    proc = run_cli("--model", "nobody/no-such-model-xyz", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, "--model nobody/no-such-model-xyz", "not in the local cache", "HF_HUB_OFFLINE")


def test_missing_dataset_file_fails_before_loading():
    assert_one_line_error(run_cli("--dataset", "/nonexistent/data.csv"), "--dataset /nonexistent/data.csv")


def test_hub_dataset_while_offline_fails_at_once():
    proc = run_cli("--dataset", "nobody/no-such-dataset-xyz", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, "--dataset nobody/no-such-dataset-xyz", "HF_HUB_OFFLINE")


@pytest.mark.parametrize("where", ["missing_folder", "a_folder"])
def test_unwritable_json_destination_fails_before_the_check(tmp_path, where):
    destination = str(tmp_path / "missing" / "out.json") if where == "missing_folder" else str(tmp_path)
    assert_one_line_error(run_cli("--json", destination), "--json")


def test_too_few_rows_and_missing_columns_fail_before_the_model_loads(tmp_path, csv_file):
    folder = save(BertForSequenceClassification(tiny_bert_config(num_labels=2)), tmp_path / "bert")
    proc = run_cli("--model", folder, "--dataset", csv_file, "--micro_batch_size", "8",
                   "--gradient_accumulation_steps", "8")  # fmt: skip
    assert_one_line_error(proc, "--dataset has 40 rows; the window needs 64")
    proc = run_cli("--model", folder, "--dataset", csv_file, "--text_column", "sentence")
    assert_one_line_error(proc, "--text_column sentence", "no such column")


def test_help_shows_defaults_and_exit_statuses():
    proc = run_cli("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "(default: 8)" in text and "(default: seq-cls)" in text and "(default: keep)" in text
    assert "0 exact, 1 not exact, 3 cannot decide, 2 bad usage or input, 4 internal error" in text


class _Result:
    def __init__(self, passed, verdict=None):
        self.passed = passed
        if verdict is not None:
            self.verdict = verdict


@pytest.mark.parametrize(
    ("result", "code"),
    [
        (_Result(True), 0),
        (_Result(False), 1),
        (_Result(True, "exact"), 0),
        (_Result(False, "not_exact"), 1),
        (_Result(False, "cannot_decide"), 3),
    ],
)
def test_verdict_to_exit_status(result, code):
    """A result with a three-way `verdict` maps it; one with only `passed` maps the boolean."""
    assert EXIT_CODES[verdict_of(result)] == code
