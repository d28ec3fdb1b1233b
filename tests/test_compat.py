"""The transformers compatibility layer (`hf_gradaccum/config/compat.py`), checked against the installed release.

The same file runs in every virtualenv of `make test-compat` (the oldest supported stack, a CUDA image's stack and
the newest releases) and in the main suite, so each supported release gets its own run of these checks."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import logging
import os

import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from transformers import Trainer, TrainingArguments

from hf_gradaccum import versions
from hf_gradaccum.config import compat
from hf_gradaccum.config.compat import (
    SUPPORTED_TRANSFORMERS,
    UnsupportedTransformersError,
    check_transformers_version,
)

pytestmark = pytest.mark.compat

INSTALLED = importlib.metadata.version("transformers")


def test_installed_release_is_accepted():
    assert check_transformers_version() == INSTALLED


@pytest.mark.parametrize("version", ["4.56.2", "4.57.6", "5.0.0", "5.12.1", "5.23.0", "5.24.0", "5.23.0.dev0"])
def test_tested_releases_are_accepted_without_a_warning(version, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_gradaccum"):
        assert check_transformers_version(version) == version
    assert not caplog.records


@pytest.mark.parametrize("version", ["5.25.0", "5.25.0.dev0", "6.0.0", "7.1.2+local"])
def test_newer_releases_are_accepted_with_one_warning_naming_the_newest_tested(version, caplog):
    versions._warn_newer_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_gradaccum"):
        for _ in range(3):
            assert check_transformers_version(version) == version
    assert len(caplog.records) == 1, caplog.records
    assert f"transformers {version} is newer" in caplog.text
    assert versions.TESTED["transformers"].newest in caplog.text


@pytest.mark.parametrize("version", ["4.56.1", "4.55.4", "4.46.0", "not-a-version"])
def test_releases_below_the_floor_are_refused_naming_the_floor(version):
    with pytest.raises(UnsupportedTransformersError, match=f"transformers{SUPPORTED_TRANSFORMERS}") as refused:
        check_transformers_version(version)
    assert isinstance(refused.value, ImportError)  # what `from hf_gradaccum import GradAccumTrainer` raises


def test_declared_dependencies_are_floors_without_ceilings():
    """pyproject.toml declares the checked floors of torch, transformers and accelerate and no upper bound, so a
    user's newer install is never replaced."""
    pyproject = os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml")
    with open(pyproject, "rb") as f:
        declared = tomllib.load(f)["project"]["dependencies"]
    by_name = {Requirement(r).name: Requirement(r) for r in declared}
    for package in ("torch", "transformers", "accelerate"):
        specifiers = list(by_name[package].specifier)
        oldest = versions.TESTED[package].oldest
        assert [(s.operator, s.version) for s in specifiers] in ([(">=", oldest)], [(">=", oldest.removesuffix(".0"))])


def test_a_missing_private_name_fails_at_the_feature_naming_it(tmp_path, monkeypatch):
    """A release without a private detail breaks the feature that needs it, at construction, with a clear message;
    importing the package and building a trainer without the feature still work."""
    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    monkeypatch.delattr(Trainer, "_get_output_dir")
    args = GradAccumArguments(str(tmp_path), report_to=[], use_cpu=True)
    GradAccumTrainer(model=torch.nn.Linear(2, 2), args=args)
    atomic = GradAccumArguments(str(tmp_path), report_to=[], use_cpu=True, atomic_checkpoints=True)
    with pytest.raises(
        compat.MissingTransformersFeatureError, match=r"`atomic_checkpoints=True` needs Trainer\._get_output_dir"
    ):
        GradAccumTrainer(model=torch.nn.Linear(2, 2), args=atomic)


def _tiny_trainer(tmp_path, **args):
    model = torch.nn.Linear(2, 2)
    return Trainer(model=model, args=TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **args))


def _make_checkpoints(run_dir, steps):
    for i, step in enumerate(steps):
        path = run_dir / f"checkpoint-{step}"
        path.mkdir()
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # creation order, for use_mtime=True


@pytest.mark.parametrize("use_mtime", [True, False])
def test_rotate_checkpoints_keeps_the_newest_within_the_limit(tmp_path, use_mtime):
    trainer = _tiny_trainer(tmp_path / "out", save_total_limit=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _make_checkpoints(run_dir, [1, 2, 3, 4])
    compat.rotate_checkpoints(trainer, output_dir=str(run_dir), use_mtime=use_mtime)
    assert sorted(os.listdir(run_dir)) == ["checkpoint-3", "checkpoint-4"]


def test_rotate_checkpoints_keeps_the_best_checkpoint(tmp_path):
    trainer = _tiny_trainer(tmp_path / "out", save_total_limit=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _make_checkpoints(run_dir, [1, 2, 3, 4])
    trainer.state.best_model_checkpoint = str(run_dir / "checkpoint-1")
    compat.rotate_checkpoints(trainer, output_dir=str(run_dir), use_mtime=True)
    remaining = sorted(os.listdir(run_dir))
    assert "checkpoint-1" in remaining and "checkpoint-4" in remaining and len(remaining) == 2


def test_rotate_checkpoints_without_a_limit_deletes_nothing(tmp_path):
    trainer = _tiny_trainer(tmp_path / "out")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _make_checkpoints(run_dir, [1, 2, 3])
    compat.rotate_checkpoints(trainer, output_dir=str(run_dir))
    assert len(os.listdir(run_dir)) == 3


@pytest.fixture(scope="module")
def built_trainer(tmp_path_factory):
    return _tiny_trainer(tmp_path_factory.mktemp("built"))


@pytest.mark.parametrize("name", list(compat.PRIVATE_TRAINER_NAMES))
def test_private_trainer_names_exist_in_the_installed_release(name, built_trainer):
    owner, attribute = name.split(".", 1)
    if owner == "Trainer":
        assert hasattr(Trainer, attribute), f"transformers {INSTALLED}: Trainer has no {attribute}"
    elif owner == "args":
        assert attribute in {f.name for f in dataclasses.fields(TrainingArguments)}
    else:
        obj = built_trainer
        for part in attribute.split("."):
            assert hasattr(obj, part), f"transformers {INSTALLED}: no {name}"
            obj = getattr(obj, part)


def test_public_hooks_have_the_signatures_the_adapter_overrides():
    """`get_batch_samples(epoch_iterator, num_batches, device)` returning (batches, num_items_in_batch), and
    `training_step(model, inputs, num_items_in_batch)`: the loop's calls GradAccumTrainer overrides."""
    assert list(inspect.signature(Trainer.get_batch_samples).parameters) == [
        "self",
        "epoch_iterator",
        "num_batches",
        "device",
    ]
    assert list(inspect.signature(Trainer.training_step).parameters)[:4] == [
        "self",
        "model",
        "inputs",
        "num_items_in_batch",
    ]
