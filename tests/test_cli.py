"""`hf-gradaccum verify` smoke tests on a tiny model folder and a csv file (the offline MiniLM default is timed in
docs/verification.md; it takes ~15 s, too slow for the default run)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertForSequenceClassification

from hf_gradaccum.cli import main
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


def test_console_entry_point_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "hf_gradaccum.cli", "verify", "--micro_batch_size", "0"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "--micro_batch_size must be an integer >= 1" in proc.stderr
