"""A user's `Trainer` subclass moved onto `GradAccumTrainer`: its `training_step` override is the large batch's step
or stopped before the first optimizer step, because the window follows the Trainer's loop (`trainer/loop_calls.py`).

Each case is one of `tests/subclass_cases.py`'s mixins, trained one SGD step on the same 12 rows: the stock `Trainer`
on one batch of 12 (the reference) and `GradAccumTrainer` at 3 x 4, each from the same initial weights (CPU fp32). The
update must match the reference's within 1e-5 relative (`RTOL`), or the run must stop before any optimizer step with
the weights unchanged and the reason named.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tests.subclass_cases as cases
from tests.subclass_cases import RTOL

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# Cases whose large batch is the plain step (`Case.large_batch`: the override only logs, copies the stock body,
# divides by the accumulation steps, which is 1 at one batch, or multiplies by a factor that is 1.0 at step 0): one
# reference for all of them, the stock Trainer's one batch of 12 with the plain loader case.
PLAIN_STEP = frozenset(
    {
        "log_loss_after_super",
        "curriculum_global_step",
        "stock_body_copy",
        "older_shape_divide_by_ga",
        "oldest_shape_loss_backward",
        "super_without_num_items",
        "grad_norm_logging",
        "stock_body_copy_parent_order",
        "older_shape_parent_order",
        "backward_in_compute_loss",
    }
)


def _reference(name: str) -> torch.Tensor:
    return _stock_one_batch("own_train_dataloader" if name in PLAIN_STEP else name)


@functools.cache
def _stock_one_batch(name: str) -> torch.Tensor:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        run = cases.train_once(cases.find_case(name), "reference", d)
    assert "exception" not in run, run.get("exception")
    return run["update"]


def _ours(name: str, tmp_path) -> dict:
    return cases.train_once(cases.find_case(name), "ours", str(tmp_path))


def _relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


EXACT = {
    # copied bodies: bypass the accumulator; their own division is made each micro-batch's exact share
    "stock_body_copy": "bypassed",
    "older_shape_divide_by_ga": "bypassed",
    "older_shape_ignored_rows": "bypassed",
    "oldest_shape_loss_backward": "bypassed",
    "backward_in_compute_loss": "bypassed",
    "rdrop_own_step": "bypassed",
    # the same bodies in the user's `Trainer` subclass after GradAccumTrainer: the parents' step, division undone
    "stock_body_copy_parent_order": None,
    "older_shape_parent_order": None,
    # `super()` once, twice, with code after it
    "super_twice_token_drop": "accumulated",
    "clip_grad_value_after_super": "accumulated",
    "grad_norm_logging": "accumulated",
    "log_loss_after_super": "accumulated",
    "mask_old_vocab_grad": "accumulated",
    "mask_old_vocab_grad_guarded": "accumulated",
    "zero_embedding_grad_at_sync": "accumulated",
    "super_without_num_items": "accumulated",
    "passthrough_max_grad_norm": "accumulated",
    # the overrides that were exact before the loop calls were followed
    "llrd_create_optimizer": None,
    "weighted_random_sampler": None,
    "own_train_dataloader": None,
    "curriculum_global_step": None,
}


def _five_x_only(name: str) -> None:
    """The cases written against transformers 5.x: the copied 5.24 body reads `loss_is_scaled_for_ga` (4.x lacks it,
    under the stock Trainer too), and 4.x's loader hands R-Drop's extra `noise` column on to the model."""
    from transformers import Trainer

    if name.startswith("stock_body_copy") and not hasattr(Trainer, "loss_is_scaled_for_ga"):
        pytest.skip("the copied body is transformers 5.24's")
    if name == "rdrop_own_step" and not hasattr(Trainer, "loss_is_scaled_for_ga"):
        pytest.skip("transformers 4.x passes the `noise` column to the model")


@pytest.mark.parametrize("name", sorted(EXACT))
def test_override_is_the_large_batch_step(name, tmp_path):
    _five_x_only(name)
    run = _ours(name, tmp_path)
    assert "exception" not in run, run["exception"]["traceback"]
    assert run["optimizer_steps"] == 1
    assert _relative(run["update"], _reference(name)) <= RTOL
    # The record says which path ran: an override that bypassed the accumulator is never reported as accumulated.
    recorded = (run.get("accumulation_check") or {}).get("training_step")
    if EXACT[name] is None:
        assert recorded is None
    else:
        assert list(recorded["paths"]) == [EXACT[name]], recorded


@pytest.mark.parametrize(
    "name, reason",
    [
        ("fgm_adversarial", "changed the model's parameters inside a window of several micro-batches"),
        ("sam_two_step", "changed the model's parameters between two `super().training_step(...)` calls"),
        ("own_step_without_division", "without reading the accumulation steps"),
    ],
)
def test_override_that_cannot_be_exact_stops_before_the_first_step(name, reason, tmp_path):
    run = _ours(name, tmp_path)
    error = run.get("exception")
    assert error is not None, "trained instead of stopping"
    assert error["type"] == "OverrideStop"
    assert reason in error["message"]
    assert cases.find_case(name).mixin.__name__ in error["message"]  # names the user's class
    assert run["optimizer_steps"] == 0 and not run["moved"]


def test_stock_at_accumulation_is_not_the_large_batch_for_the_stopped_and_bypassed_cases(tmp_path):
    """The cases above can fail: the stock Trainer at 3 x 4 is off on the ignored-rows case (its hand division by 4
    is not the micro-batches' share) and on the sum the division-free own step makes."""
    for name in ("older_shape_ignored_rows", "own_step_without_division"):
        run = cases.train_once(cases.find_case(name), "stock", str(tmp_path / name))
        assert _relative(run["update"], _reference(name)) > 100 * RTOL


def test_fgm_at_one_micro_batch_per_window_is_the_stock_step(tmp_path):
    """With `gradient_accumulation_steps=1` the window is the batch: FGM runs, equal to the stock Trainer's."""
    case = cases.find_case("fgm_adversarial")
    import dataclasses

    single = dataclasses.replace(case, name="fgm_single")
    original = cases.users_losses.RUNS["ours"]
    cases.users_losses.RUNS["ours"] = (cases.ROWS, 1)
    try:
        run = cases.train_once(single, "ours", str(tmp_path))
    finally:
        cases.users_losses.RUNS["ours"] = original
    assert "exception" not in run, run["exception"]["traceback"]
    assert _relative(run["update"], _reference("fgm_adversarial")) <= RTOL


def _with_mixin(mixin: type, name: str) -> cases.Case:
    """The plain case (`own_train_dataloader`'s rows and reference) with another mixin."""
    import dataclasses

    return dataclasses.replace(cases.find_case("own_train_dataloader"), name=name, mixin=mixin)


def test_backward_inside_compute_loss_of_a_mean_is_exact(tmp_path):
    """`compute_loss` back-propagates the model's mean itself and returns it detached (the Trainer's own
    `training_step`): the accumulator's weight reaches that backward."""
    run = cases.train_once(_with_mixin(cases.BackwardInsideComputeLossOnly, "inside_only"), "ours", str(tmp_path))
    assert "exception" not in run, run["exception"]["traceback"]
    assert run["notes"]["backwards_in_compute_loss"] >= 4
    assert _relative(run["update"], _reference("own_train_dataloader")) <= RTOL


def test_backward_inside_compute_loss_divided_by_the_steps_stops_with_the_fix(tmp_path):
    run = cases.train_once(_with_mixin(cases.BackwardInsideComputeLossDivided, "divided"), "ours", str(tmp_path))
    error = run.get("exception")
    assert error is not None and "drop the division" in error["message"]
    assert "BackwardInsideComputeLossDivided" in error["message"]  # the user's class
    assert run["optimizer_steps"] == 0 and not run["moved"]


def test_code_after_super_sees_copies_mid_window_and_the_window_gradient_last(tmp_path):
    """Mid-window `.grad` holds the mean so far (a copy: changes do not reach the step); on the window's last
    micro-batch it holds the window's gradient, the one the optimizer steps with."""

    seen = []

    class Watch:
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            weight = model.classifier.weight
            seen.append((self.accelerator.sync_gradients, weight.grad.clone()))
            weight.grad.mul_(1000.0 if not self.accelerator.sync_gradients else 1.0)  # discarded mid-window
            return loss

    from tests.users_losses_cases import LEARNING_RATE

    run = cases.train_once(_with_mixin(Watch, "watch"), "ours", str(tmp_path))
    assert "exception" not in run, run["exception"]["traceback"]
    assert _relative(run["update"], _reference("own_train_dataloader")) <= RTOL
    assert [last for last, _ in seen] == [False, False, False, True]
    final = seen[-1][1]
    # the classifier's weight is the last `weight` parameter of the flat update; SGD: update = -lr * gradient
    stepped = -run["update"][-final.numel() - 3 : -3].float().reshape(final.shape) / LEARNING_RATE
    assert _relative(stepped, final) <= RTOL
    # the mean so far grows towards the window's mean: the first micro-batch's share is about a quarter of it
    assert 0.05 < float(seen[0][1].norm() / final.norm()) < 1.0


def test_a_bypassed_window_with_a_non_finite_gradient_is_not_applied(tmp_path):
    """An override that back-propagates by itself never reaches the accumulator's check: its window's gradient is
    checked where the window ends, and a NaN leaves the weights as they were (the stock Trainer would step on it)."""

    class NaNInSecondMicroBatch(cases.OlderShape):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = model(**inputs).loss
            # (the first window's measurement runs this loss before any training step: left finite there)
            second = getattr(self, "case_notes", {}).get("user_steps") == 2
            return loss * float("nan") if second else loss

    run = cases.train_once(_with_mixin(NaNInSecondMicroBatch, "nan_bypass"), "ours", str(tmp_path))
    assert "exception" not in run, run["exception"]["traceback"]
    assert run["optimizer_steps"] == 1
    assert float(run["update"].abs().max()) == 0.0


def test_loss_backward_after_reading_the_steps_in_a_parent_step_stops_with_the_verified_fix(tmp_path):
    """The oldest shape (`loss / args.gradient_accumulation_steps`, `loss.backward()`) in the user's `Trainer`
    subclass composed after GradAccumTrainer: its division cannot be seen, so it stops and says to use
    `self.accelerator.backward(loss)`, which `older_shape_parent_order` (exact, above) is."""
    import dataclasses

    case = dataclasses.replace(cases.find_case("oldest_shape_loss_backward"), name="oldest_after", parent_order=True)
    run = cases.train_once(case, "ours", str(tmp_path))
    error = run.get("exception")
    assert error is not None and "self.accelerator.backward(loss)" in error["message"]
    assert run["optimizer_steps"] == 0 and not run["moved"]


@pytest.mark.parametrize("mode", ["mutate", "bypass"])
def test_overrides_under_ddp(mode, tmp_path):
    """Two real gloo processes: a change to `.grad` after `super()` in the middle of a window does not reach the step
    (exact against one SGD step per window on both ranks' rows as one batch); a body that bypasses the accumulator
    stops before the first step (not yet exact under several processes)."""
    from tests.multiprocess import launch

    proc = launch(mode, str(tmp_path), script="tests/workers/subclass_ddp.py")
    assert ("relative update error" if mode == "mutate" else "stopped:") in proc.stdout, proc.stdout[-2000:]


def _in_place(trainer) -> None:
    if hasattr(trainer.args, "accumulation_path"):  # ours only (the stock arguments have no such field)
        trainer.args.accumulation_path = "in_place"


@pytest.mark.parametrize("name", ["super_twice_token_drop", "clip_grad_value_after_super", "mask_old_vocab_grad"])
def test_overrides_on_the_in_place_path(name, tmp_path):
    """The same overrides with the accumulation in `.grad` itself (`accumulation_path="in_place"`): the copies shown
    mid-window and the reopened last window work on autograd's own sums too."""
    import dataclasses

    case = dataclasses.replace(cases.find_case(name), name=f"{name}_in_place", prepare=_in_place)
    seen = {}

    def observe(out, trainer, dataset):
        seen["in_place"] = trainer.accumulator.in_place

    run = cases.users_losses.train_once(case, "ours", str(tmp_path), cases_file="tests/subclass_cases.py",
                                        observe=observe)  # fmt: skip
    assert "exception" not in run, run["exception"]["traceback"]
    assert seen["in_place"]
    assert _relative(run["update"], _reference(name)) <= RTOL
