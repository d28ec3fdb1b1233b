"""Coupled-loss mode through the Trainer (`GradAccumTrainer(coupled_loss=...)`): one optimizer step (SGD, lr 1, no
clipping) over a window of uneven micro-batches (4, 4, 2) with dropout ON equals the large-batch step over the same 10 samples with
the same dropout masks (one graph, each micro-batch's forward from the RNG state it had in pass 1); plain
accumulation through `GradAccumTrainer` (each micro-batch's own in-batch loss) is shown next to it."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from tests.workers.coupled_cases import (
    CASES,
    clip_batches,
    generic_batches,
    ranking_batches,
    reference_gradient,
    relative_error,
)

TOL = 1e-5


def _rows(case: str) -> list[dict]:
    batches = {"generic": generic_batches, "clip": clip_batches, "ranking": ranking_batches}[case]((10,))
    rows = [{k: v[i] for k, v in batches[0].items() if k != "target"} for i in range(10)]
    return rows


def _args(tmp_path, dropout_seed: int = 0, use_cpu: bool = True) -> GradAccumArguments:
    return GradAccumArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        remove_unused_columns=False,
        report_to="none",
        save_strategy="no",
        use_cpu=use_cpu,
        seed=dropout_seed,
        logging_steps=1,
        disable_tqdm=True,
    )


class PlainInBatchTrainer(GradAccumTrainer):
    """Plain accumulation of an in-batch loss: each micro-batch's own loss, item (row) weighted, the declared count
    unchecked (its check would stop it: see the test below), so that the coupled mode has something to beat."""

    def __init__(self, *args, coupled_loss, **kwargs):
        super().__init__(*args, **kwargs)
        self.coupled_loss = coupled_loss
        self.args.check_declared_normalisation = False

    def count_micro_batch_items(self, inputs):
        return self.coupled_loss.num_items_fn(inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = self.coupled_loss.window_loss(model, [inputs])
        return (loss, {"loss": loss}) if return_outputs else loss


def _update(model0, trainer_model) -> torch.Tensor:
    return torch.cat(
        [
            (p1.detach() - p0.detach()).reshape(-1)
            for p0, p1 in zip(model0.parameters(), trainer_model.parameters(), strict=True)
        ]
    )


@pytest.mark.parametrize("case", ["generic", "clip", "ranking"])
def test_trainer_coupled_step_equals_large_batch(tmp_path, case):
    torch.manual_seed(0)
    model, coupled, _ = CASES[case](0.1, check_recompute=True)
    model0 = copy.deepcopy(model)
    rows = _rows(case)
    trainer = GradAccumTrainer(model=model, args=_args(tmp_path / "coupled"), train_dataset=rows, coupled_loss=coupled)
    trainer.train()
    window = coupled.last_window
    batches = trainer.coupled_mode.batches
    assert [len(next(iter(b.values()))) for b in batches] == [4, 4, 2]
    assert window.recompute_max_abs_diff == [0.0, 0.0, 0.0]  # pass 2 == pass 1, bitwise, dropout on
    ref_update = -reference_gradient(model0, coupled, batches, window.rng_states)
    got = _update(model0, trainer.model)
    err = relative_error(got, ref_update)
    # the logged training loss is the window (large-batch) loss
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged and abs(logged[0] - float(window.loss)) <= 1e-4 * abs(float(window.loss))

    plain_model = copy.deepcopy(model0)
    plain = PlainInBatchTrainer(
        model=plain_model, args=_args(tmp_path / "plain"), train_dataset=rows, coupled_loss=coupled
    )
    plain.train()
    plain_err = relative_error(_update(model0, plain.model), ref_update)
    print(f"Trainer {case}: coupled {err:.2e}, plain accumulation {plain_err:.2e}")
    assert err <= TOL, err
    assert plain_err > 1e-2, plain_err


def test_trainer_refuses_auto_find_batch_size(tmp_path):
    model, coupled, _ = CASES["generic"](0.0)
    args = _args(tmp_path)
    args.auto_find_batch_size = True
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        GradAccumTrainer(model=model, args=args, train_dataset=_rows("generic"), coupled_loss=coupled)
    with pytest.raises(ValueError, match="coupled_loss"):
        GradAccumTrainer(model=model, args=_args(tmp_path), train_dataset=_rows("generic"), coupled_loss=object())


@pytest.mark.parametrize("case", ["clip", "ranking"])
def test_trainer_verify_accumulation_uses_the_coupled_check(tmp_path, case):
    """`verify_accumulation='first_step'` in the coupled-loss mode runs the coupled check (exact, written to
    accumulation_check.json) and leaves the step exact; the ordinary check on plain accumulation of the same in-batch
    loss reports NOT exact."""
    import json

    torch.manual_seed(0)
    model, coupled, _ = CASES[case](0.1)
    model0 = copy.deepcopy(model)
    rows = _rows(case)
    args = _args(tmp_path / "coupled")
    args.verify_accumulation, args.verify_raise = "first_step", True
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=rows, coupled_loss=coupled)
    trainer.train()  # would raise AccumulationNotExactError if the check said not exact
    record = json.loads((tmp_path / "coupled" / "accumulation_check.json").read_text())
    assert record["passed"] and record["max_rel_diff"] <= TOL, record
    assert any("coupled-loss mode" in note for note in record["notes"]), record
    # The check left the step what it is without it: the large-batch step.
    ref_update = -reference_gradient(model0, coupled, trainer.coupled_mode.batches, coupled.last_window.rng_states)
    assert relative_error(_update(model0, trainer.model), ref_update) <= TOL

    plain_args = _args(tmp_path / "plain")
    plain_args.verify_accumulation = "first_step"
    plain = PlainInBatchTrainer(model=copy.deepcopy(model0), args=plain_args, train_dataset=rows, coupled_loss=coupled)
    plain.train()
    plain_record = json.loads((tmp_path / "plain" / "accumulation_check.json").read_text())
    assert not plain_record["passed"] and plain_record["max_rel_diff"] > 1e-2, plain_record


def test_coupled_loss_behind_another_trainer_is_refused(tmp_path):
    """The coupled mode replaces the loss in `compute_loss`: behind a trainer with a `compute_loss` of its own in the
    class order, it is refused before any `__init__` runs, with the order to use."""
    from transformers import Trainer

    class OwnLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class OwnLossFirst(OwnLossTrainer, GradAccumTrainer):
        pass

    class GradAccumFirst(GradAccumTrainer, OwnLossTrainer):
        pass

    model, coupled, _ = CASES["generic"](0.0)
    with pytest.raises(ValueError, match=r"`coupled_loss` needs GradAccumTrainer before OwnLossTrainer"):
        OwnLossFirst(model=model, args=_args(tmp_path), train_dataset=_rows("generic"), coupled_loss=coupled)
    trainer = GradAccumFirst(model=model, args=_args(tmp_path), train_dataset=_rows("generic"), coupled_loss=coupled)
    assert trainer.coupled_mode is not None and trainer.coupled_mode.coupled_loss is coupled


def test_plain_accumulation_of_an_in_batch_loss_stops_where_its_count_is_checked(tmp_path):
    from hf_gradaccum.losses.model_losses import ModelLossError

    class Checked(PlainInBatchTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.args.check_declared_normalisation = True

    torch.manual_seed(0)
    model, coupled, _ = CASES["generic"](0.1, check_recompute=True)
    rows = _rows("generic")
    trainer = Checked(model=model, args=_args(tmp_path), train_dataset=rows, coupled_loss=coupled)
    with pytest.raises(ModelLossError, match="count_micro_batch_items` is contradicted by the first window"):
        trainer.train()
