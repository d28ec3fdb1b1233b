"""An in-place window that ends inside the Trainer's clipping (`trainer/window_end.py`): the division by the
window's items, the non-finite check and the clipping share clipping's two passes over the gradients, so
GradAccumTrainer runs the same gradient-wide kernels as the stock Trainer. Exactness against the hand-computed
large batch, clipped (rtol 1e-5, fp32); the logged norm; a non-finite window still skipped; a subclass that touches
the gradients after `training_step` still sees the mean; and no optimizer step ever sees a window's sums."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer, default_data_collator

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator
from hf_gradaccum.trainer.window_end import CLIPPING_METHODS
from tests.parity_cases import (
    CASES,
    LAYOUTS,
    large_batch_reference,
    reference_windows,
    relative_update_error,
    train_with,
)

RTOL = 1e-5
# transformers 4.x clips inline in its loop: there the window ends before the clipping, as before.
CLIPS_THROUGH_METHODS = all(hasattr(Trainer, name) for name in CLIPPING_METHODS)
needs_clipping_methods = pytest.mark.skipif(not CLIPS_THROUGH_METHODS, reason="this transformers clips inline")
CASE_BY_NAME = {c.name: c for c in CASES}
GRADIENT_WIDE_KERNELS = ("_foreach_norm", "_foreach_mul_", "_amp_foreach_non_finite_check_and_unscale_")


class WhereWindowsEnd(GradAccumTrainer):
    """Records each window's result and whether it ended inside the Trainer's clipping."""

    def on_window_end(self, result):
        super().on_window_end(result)
        callers = {frame.function for frame in inspect.stack()[1:8]}
        self.__dict__.setdefault("ends", []).append((result, bool(callers & {"_clip_grad_norm", "_get_grad_norm"})))


class KernelCount(TorchDispatchMode):
    """Counts the gradient-wide multi-tensor kernels that run (aten overloads, by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = dict.fromkeys(GRADIENT_WIDE_KERNELS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-3, 1e6])
@pytest.mark.parametrize("name", ["bert_seq_cls", "gpt2_causal_lm"])
def test_window_ending_in_clipping_equals_the_clipped_large_batch(tmp_path, name, max_grad_norm):
    case = CASE_BY_NAME[name]
    torch.manual_seed(0)
    model = case.make_model()
    n, micro, steps = LAYOUTS["partial_last_window"]  # windows of 16 and 6 samples
    data = case.make_data(n, torch.Generator().manual_seed(1))
    trained, trainer = train_with(
        WhereWindowsEnd, case, model, data, micro, steps, str(tmp_path), max_grad_norm=max_grad_norm
    )
    norms: list[float] = []
    windows = reference_windows(n, micro, steps)
    reference = large_batch_reference(case, model, data, windows, max_grad_norm=max_grad_norm, norms=norms)
    err = relative_update_error(model, trained, reference)
    results = [result for result, _ in trainer.ends]
    print(f"{name} max_grad_norm={max_grad_norm}: update error {err:.2e}, norms {[r.grad_norm for r in results]}")
    assert trainer.accumulator.in_place
    assert [in_clipping for _, in_clipping in trainer.ends] == [CLIPS_THROUGH_METHODS] * 2
    assert err <= RTOL
    # The norm the Trainer logs is the large-batch gradient's, before clipping.
    if CLIPS_THROUGH_METHODS:
        assert [r.grad_norm for r in results] == pytest.approx(norms, rel=RTOL)
    if max_grad_norm == 1e-3:
        assert all(norm > 10 * max_grad_norm for norm in norms)  # the clipping bit


@needs_clipping_methods
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_the_trainer_runs_the_stock_trainers_gradient_wide_kernels(tmp_path, max_grad_norm):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(16, torch.Generator().manual_seed(1))
    counts = {}
    for cls in (Trainer, GradAccumTrainer):
        with KernelCount() as kernels:
            train_with(cls, case, model, data, 4, 4, str(tmp_path / cls.__name__), max_grad_norm=max_grad_norm)
        counts[cls.__name__] = kernels.counts
    print(counts)
    assert counts["GradAccumTrainer"] == counts["Trainer"]
    assert counts["Trainer"]["_foreach_norm"] >= 1  # the clipping ran (transformers measures at 0 too)


def test_a_non_finite_gradient_still_skips_the_window(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(16, torch.Generator().manual_seed(1))
    poisoned = copy.deepcopy(model)
    forwards = []

    def poison_first_window(module, inputs, output):
        forwards.append(1)
        if len(forwards) <= 2:  # the first window: 2 micro-batches of 4
            output.register_hook(lambda grad: grad * math.nan)

    # The loss stays finite; the gradients of the first window are NaN (a module hook survives the Trainer's copy).
    poisoned.classifier.register_forward_hook(poison_first_window)
    # The rule named and left unchecked: the first window's measurement would run forwards of its own through the
    # poisoning hook.
    trained, trainer = train_with(
        WhereWindowsEnd,
        case,
        poisoned,
        data,
        4,
        2,
        str(tmp_path),
        max_grad_norm=1.0,
        loss_normalisation="label_tokens",
        check_declared_normalisation=False,
    )
    (first, first_in_clipping), (second, second_in_clipping) = trainer.ends
    assert first_in_clipping == second_in_clipping == CLIPS_THROUGH_METHODS
    assert not first.applied and first.skip_reason == "non_finite_grad" and second.applied
    assert trainer.accumulator.skipped_steps["non_finite_grad"] == 1
    # Weights as after the second window's clipped large-batch step alone.
    reference = large_batch_reference(case, model, data, [list(range(8, 16))], max_grad_norm=1.0)
    assert all(torch.isfinite(p).all() for p in trained.parameters())
    assert relative_update_error(model, trained, reference) <= RTOL


class ClipsByValue(GradAccumTrainer):
    """A subclass that changes the window's gradient after `training_step` returns: it must see the mean."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        return loss


def test_a_subclass_overriding_training_step_keeps_the_window_end_before_it(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(16, torch.Generator().manual_seed(1))
    trained, _ = train_with(ClipsByValue, case, model, data, 4, 4, str(tmp_path))
    reference = copy.deepcopy(model)
    loss = reference(**default_data_collator([data[i] for i in range(16)])).loss
    loss.backward()
    torch.nn.utils.clip_grad_value_(reference.parameters(), 1e-3)
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    assert relative_update_error(model, trained, reference) <= RTOL


def _trainer_with_a_pending_window(tmp_path, model, batch):
    args = GradAccumArguments(
        str(tmp_path), use_cpu=True, report_to=[], learning_rate=1.0, optim="sgd", weight_decay=0.0, max_grad_norm=1.0
    )
    trainer = GradAccumTrainer(model=model, args=args)
    trainer.create_optimizer()
    trainer._training = True  # as inside `train()`: the window's end waits for the clipping
    trainer.training_step(model, batch)
    assert trainer._window_end.pending is trainer.accumulator
    return trainer


@needs_clipping_methods
def test_an_optimizer_step_never_sees_a_windows_sums(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(6, torch.Generator().manual_seed(1))
    batch = default_data_collator([data[i] for i in range(6)])
    reference = large_batch_reference(case, model, data, [list(range(6))])

    # Stepped without the clipping: the step pre-hook ends the window first, exactly.
    trained = copy.deepcopy(model)
    trainer = _trainer_with_a_pending_window(tmp_path / "a", trained, batch)
    trainer.optimizer.step()
    assert trainer._window_end.pending is None and trainer.accumulator.last_result.applied
    assert relative_update_error(model, trained, reference) <= RTOL

    # Clipped by code that is not GradAccumTrainer's: the sums changed, the step is refused, the weights untouched.
    trained = copy.deepcopy(model)
    trainer = _trainer_with_a_pending_window(tmp_path / "b", trained, batch)
    torch.nn.utils.clip_grad_norm_(trained.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="still sums"):
        trainer.optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trained.parameters(), strict=True))


@pytest.mark.parametrize("path", ["in_place", "hooks"])
@pytest.mark.parametrize("scale", [1.0, 1e18])
def test_plain_loop_clipping_equals_the_clipped_large_batch(path, scale):
    """`step(max_grad_norm=...)` ends the window with the clipping; at 1e18 the squares of the summed gradients
    overflow fp32 (the mean's do not), which only the exact check may tell from a real inf."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    reference = copy.deepcopy(model).double()
    (torch.nn.functional.mse_loss(reference(x.double()), y.double()) * scale).backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad

    trained = copy.deepcopy(model)
    acc = GradientAccumulator(trained, 3, accumulation_path=path)
    optimizer = torch.optim.SGD(trained.parameters(), lr=1.0)
    for rows in (slice(0, 5), slice(5, 7), slice(7, 12)):
        loss = torch.nn.functional.mse_loss(trained(x[rows]), y[rows], reduction="sum") / (
            3 * (rows.stop - rows.start)
        )
        acc.backward(loss * scale, num_items=rows.stop - rows.start)
    result = acc.step(optimizer, max_grad_norm=0.5)
    assert result.applied and result.grad_norm == pytest.approx(expected_norm, rel=RTOL)
    got = torch.cat([p.detach().flatten().double() for p in trained.parameters()])
    want = torch.cat([p.detach().flatten() for p in reference.parameters()])
    start = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    assert float((got - want).norm() / (want - start).norm()) <= RTOL


@pytest.mark.parametrize("bad", [0, -1.0, "1.0", True])
def test_bad_max_grad_norm_is_refused_before_the_window_ends(bad):
    model = torch.nn.Linear(2, 1)
    acc = GradientAccumulator(model, 1)
    acc.backward(model(torch.ones(3, 2)).sum(), num_items=3)
    with pytest.raises(ValueError, match="max_grad_norm"):
        acc.finish_window(max_grad_norm=bad)
    assert acc.micro_steps_in_window == 1  # nothing ended
