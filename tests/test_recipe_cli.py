"""The recipes' command line as a newcomer meets it: `--help` shows the defaults that run (the YAML's), and every bad
number stops the recipe with exit code 2 and a message naming the argument, before any arm starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_configs import load_recipe

ROOT = Path(__file__).resolve().parents[1]
# recipe -> the YAML it reads when no --config is given
RECIPES = {"finetune_bert": "finetune_bert.yaml", "finetune_resnet": "finetune_resnet.yaml"}


def run_recipe(recipe: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"recipes/{recipe}.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _help_defaults(help_text: str) -> dict[str, str]:
    """option -> the text inside its `(default: ...)`, from argparse's help (one entry per `  --option` line)."""
    defaults = {}
    for entry in re.split(r"\n(?=  -)|\n\n", help_text):  # options, and the end of each option group
        match = re.match(r"\s+--(\w+)", entry)
        found = re.search(r"\(default: (.*?)\)\s*$", re.sub(r"\s+", " ", entry))
        if match and found:
            defaults[match.group(1)] = found.group(1)
    return defaults


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_help_shows_every_yaml_default(recipe):
    proc = run_recipe(recipe, "--help")
    assert proc.returncode == 0, proc.stderr
    shown = _help_defaults(proc.stdout)
    assert shown.get("config") == f"configs/{RECIPES[recipe]}", shown.get("config")
    wrong = yaml_values_not_shown(proc.stdout, ROOT / "configs" / RECIPES[recipe])
    assert not wrong, f"--help shows (yaml value, shown default): {wrong}"


def yaml_values_not_shown(help_text: str, config: Path) -> dict[str, tuple]:
    """The keys of the YAML `config` whose value `--help` does not show as the default: {key: (value, shown)}."""
    shown = _help_defaults(help_text)
    wrong = {}
    for key, value in yaml.safe_load(config.read_text()).items():
        text = shown.get(key)
        if value is None:
            ok = text == "None"
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            ok = text is not None and float(text) == float(value)
        elif isinstance(value, list):
            ok = text is not None and text.replace("'", "") == str(value).replace("'", "")
        else:
            ok = text == str(value)
        if not ok:
            wrong[key] = (value, text)
    return wrong


def test_help_defaults_follow_the_config_given():
    proc = run_recipe("finetune_bert", "--config", "configs/finetune_bert_tiny.yaml", "--help")
    shown = _help_defaults(proc.stdout)
    tiny = yaml.safe_load((ROOT / "configs" / "finetune_bert_tiny.yaml").read_text())
    assert shown["config"] == "configs/finetune_bert_tiny.yaml"
    assert int(shown["max_train_samples"]) == tiny["max_train_samples"]


BAD_NUMBERS = [
    ("finetune_bert", "per_device_train_batch_size", "0"),
    ("finetune_bert", "learning_rate", "-1"),
    ("finetune_bert", "num_train_epochs", "0"),
    ("finetune_bert", "weight_decay", "-0.1"),
    ("finetune_bert", "max_grad_norm", "nan"),
    ("finetune_bert", "per_device_eval_batch_size", "0"),
    ("finetune_bert", "max_length", "1"),
    ("finetune_bert", "max_train_samples", "0"),
    ("finetune_bert", "loss_tolerance", "-1"),
    ("finetune_bert", "max_memory_mb", "0"),
    ("finetune_bert", "gradient_accumulation_steps", "0"),
    ("finetune_resnet", "per_device_train_batch_size", "0"),
    ("finetune_resnet", "learning_rate", "-1"),
    ("finetune_resnet", "image_size", "4"),
    ("finetune_resnet", "groupnorm_groups", "0"),
]


@pytest.mark.parametrize(("recipe", "option", "value"), BAD_NUMBERS, ids=[f"{r}-{o}={v}" for r, o, v in BAD_NUMBERS])
def test_bad_number_exits_2_naming_the_argument_before_any_arm(recipe, option, value, tmp_path, capsys):
    # In-process (the recipe's `main` returns the exit status); one real process per recipe below.
    status = load_recipe(recipe).main([f"--{option}", value, "--output_dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 2, (status, out[-1000:], err[-2000:])
    assert f"`{option}`" in err, err
    assert "=== arm" not in out
    assert not (tmp_path / "arms").exists()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_bad_number_real_process_exit_code(recipe, tmp_path):
    proc = run_recipe(recipe, "--per_device_train_batch_size", "0", "--output_dir", str(tmp_path))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "`per_device_train_batch_size` must be an integer >= 1, got 0." in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "arms").exists()


# ---------------------------------------------------------------------------------------------------- issue 19
BAD_SOURCES = [
    ("--model_name_or_path", "/nonexistent/model", "no such folder"),
    ("--dataset_name", "/nonexistent/data", "no such file or folder"),
    ("--learning_rate", "0", "must be > 0"),
]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize(("option", "value", "says"), BAD_SOURCES, ids=[b[0].strip("-") for b in BAD_SOURCES])
def test_bad_source_or_rate_stops_before_any_arm(recipe, option, value, says, tmp_path, capsys):
    status = load_recipe(recipe).main([option, value, "--output_dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 2, (status, out[-1000:], err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{option} " in lines[0] and says in lines[0], err
    assert "=== arm" not in out and not (tmp_path / "arms").exists()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_hub_id_while_offline_stops_at_once(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status = load_recipe(recipe).main(["--model_name_or_path", "nobody/no-such-model", "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and "--model_name_or_path nobody/no-such-model" in err and "HF_HUB_OFFLINE" in err, err
    assert not (tmp_path / "arms").exists()


def test_bad_model_path_real_process_one_line(tmp_path):
    proc = run_recipe("finetune_bert", "--model_name_or_path", "/nonexistent/model", "--output_dir", str(tmp_path))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines() == [
        "finetune_bert.py: error: --model_name_or_path /nonexistent/model: no such folder, and not a Hub id."
    ]
    assert not (tmp_path / "arms").exists()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_help_shows_the_per_arm_settings_that_run_and_groups_stock_options(recipe):
    """The five defaults the issue found wrong in `--help` are the ones every arm runs with."""
    from harness.arms import arm_overrides, per_arm_settings, plan_arms

    proc = run_recipe(recipe, "--help")
    shown = _help_defaults(proc.stdout)
    assert shown["verify_accumulation"] == "first_step"
    overrides = arm_overrides(plan_arms(["accumulated"], micro_batch_size=4, gradient_accumulation_steps=2)[0], "out")
    run = dict(zip(overrides[::2], overrides[1::2], strict=True))
    for key, value in per_arm_settings().items():
        assert run[f"--{key}"].lower() == str(value).lower()
        assert shown[key].lower() == str(value).lower(), (key, shown[key], value)
    assert shown["output_dir"] == f"outputs/{recipe}"
    # The recipe's own options first; the pass-through TrainingArguments under their own heading.
    own, stock = proc.stdout.split("stock TrainingArguments options:")
    assert "--max_memory_mb" in own and "--learning_rate" in own and "--logging_steps" in own
    assert "--adam_beta1" in stock and "--adam_beta1" not in own
