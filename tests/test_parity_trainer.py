"""The parity matrix: one epoch of GradAccumTrainer (SGD lr=1, fp32, dropout off) against the hand-computed
large-batch steps on the same samples. Tolerance: relative update error <= 1e-5.

The same matrix through the stock `transformers.Trainer` runs as `xfail(strict=False)` with its measured error
printed, so the difference stays visible in every test run (`pytest -rxX`)."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_gradaccum import GradAccumTrainer
from tests.parity_cases import (
    CASES,
    LAYOUTS,
    large_batch_reference,
    reference_windows,
    relative_update_error,
    train_with,
)

RTOL = 1e-5


def _run(trainer_cls, case, layout, tmp_path, args_cls=None):
    n, micro, steps = LAYOUTS[layout]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(n, torch.Generator().manual_seed(1))
    reference = large_batch_reference(case, model, data, reference_windows(n, micro, steps))
    trained, trainer = train_with(trainer_cls, case, model, data, micro, steps, str(tmp_path), args_cls=args_cls)
    return relative_update_error(model, trained, reference), trainer


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradaccum_trainer_matches_large_batch(case, layout, tmp_path):
    err, trainer = _run(GradAccumTrainer, case, layout, tmp_path)
    print(f"GradAccumTrainer {case.name}/{layout}: relative update error {err:.2e}")
    assert err <= RTOL, f"{case.name}/{layout}: relative update error {err:.3e} > {RTOL}"
    n, micro, steps = LAYOUTS[layout]
    assert trainer.state.global_step == len(reference_windows(n, micro, steps))


def test_plain_training_arguments_accepted(tmp_path):
    err, _ = _run(GradAccumTrainer, CASES[0], "short_last_micro", tmp_path, args_cls=TrainingArguments)
    assert err <= RTOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stock_trainer_for_comparison(case, layout, tmp_path):
    err, _ = _run(Trainer, case, layout, tmp_path, args_cls=TrainingArguments)
    print(f"stock Trainer {case.name}/{layout}: relative update error {err:.2e}")
    if err > RTOL:
        pytest.xfail(f"stock transformers.Trainer: relative update error {err:.3e} (> {RTOL})")
