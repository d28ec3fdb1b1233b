"""A checkpoint written before the package's modules moved (tests/fixtures/pre_layout_checkpoint, made by
tests/fixtures/make_pre_layout_checkpoint.py at the old layout) still loads and resumes: its `training_args.bin`
pickles `GradAccumArguments` by the module path it had then (`hf_gradaccum.adapters.arguments`).

The fixture also pins the numbers: the same run made today reaches the fixture's weights at step 2, and resuming the
fixture ends where the uninterrupted run ends (1e-6 relative, fp32 on the CPU, one process)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from hf_gradaccum.diagnostics.tiny_models import tiny_model
from tests.fixtures.make_pre_layout_checkpoint import FIXTURE, arguments, dataset

RTOL = 1e-6


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_training_args_pickled_at_the_old_path_load_as_the_arguments_class():
    with pytest.warns(FutureWarning, match="hf_gradaccum.adapters.arguments` moved to `hf_gradaccum.config.arguments"):
        args = torch.load(FIXTURE / "training_args.bin", weights_only=False)
    assert type(args) is GradAccumArguments
    assert (args.gradient_accumulation_steps, args.effective_batch_size) == (3, 6)


def test_the_old_checkpoint_resumes_where_the_uninterrupted_run_ends(tmp_path):
    # The uninterrupted run, on today's layout: 4 optimizer steps, a checkpoint every 2.
    straight = GradAccumTrainer(
        model=tiny_model("causal-lm"), args=arguments(str(tmp_path / "straight"), 4), train_dataset=dataset()
    )
    straight.train()
    at_step_2 = load_file(tmp_path / "straight" / "checkpoint-2" / "model.safetensors")
    fixture = load_file(FIXTURE / "model.safetensors")
    assert _relative_difference(at_step_2, fixture) <= RTOL

    # The fixture resumed for the last 2 steps.
    out = tmp_path / "resumed"
    shutil.copytree(FIXTURE, out / "checkpoint-2")
    resumed = GradAccumTrainer(
        model=tiny_model("causal-lm", seed=5), args=arguments(str(out), 4), train_dataset=dataset()
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert resumed.accumulator.metrics()["accumulator/applied_steps"] == 4  # 2 restored from the fixture, 2 run now
    assert _relative_difference(_weights(resumed.model), _weights(straight.model)) <= RTOL
