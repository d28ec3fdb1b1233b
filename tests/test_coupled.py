"""Coupled-loss mode (gradient caching) in a plain loop: the accumulated step equals the large-batch step for losses
that couple the batch (in-batch negatives), with uneven micro-batches and dropout ON; plain accumulation does not.

What is compared (see tests/workers/coupled_cases.py):
- dropout OFF: coupled mode vs one forward/backward of the concatenated large batch (the true large batch);
- dropout ON: coupled mode vs the large-batch gradient with one graph over the window whose micro-batch forwards
  draw their dropout masks from the same RNG states as the coupled run's pass 1; and pass 2's representations are
  bitwise equal to pass 1's (`check_recompute=True` raises otherwise).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hf_gradaccum.engine.accumulator import GradientAccumulator
from hf_gradaccum.engine.loss_scaling import DynamicLossScaler
from hf_gradaccum.engine.rng import capture_rng_state, restore_rng_state
from hf_gradaccum.engine.window_losses.coupled import CoupledLoss
from tests.workers.coupled_cases import (
    CASES,
    TwoTower,
    coupled_gradient,
    generic_batches,
    generic_coupled,
    plain_gradient,
    reference_gradient,
    relative_error,
)

TOL = 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_dropout_off_equals_true_large_batch(case):
    torch.manual_seed(0)
    model, coupled, batches = CASES[case](0.0)
    ref = reference_gradient(model, coupled, batches, None)
    got, window, _ = coupled_gradient(model, coupled, batches)
    if case in ("generic", "clip"):  # the learnable temperature's gradient comes from the loss itself
        assert len(window.loss_parameter_grads) == 1
    plain = plain_gradient(model, coupled, batches)
    err, plain_err = relative_error(got, ref), relative_error(plain, ref)
    print(f"{case} dropout off: coupled {err:.2e}, plain accumulation {plain_err:.2e}")
    assert err <= TOL, err
    assert plain_err > 1e-2, plain_err  # the loss really couples the batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_dropout_on_exact_with_same_masks(case):
    torch.manual_seed(1)
    model, coupled, batches = CASES[case](0.1, check_recompute=True)
    torch.manual_seed(2)
    got, window, _ = coupled_gradient(model, coupled, batches)
    # pass 2 recomputed every micro-batch bitwise (check_recompute raised otherwise)
    assert window.recompute_max_abs_diff == [0.0] * len(batches)
    ref = reference_gradient(model, coupled, batches, window.rng_states)
    torch.manual_seed(2)
    plain = plain_gradient(model, coupled, batches)
    err, plain_err = relative_error(got, ref), relative_error(plain, ref)
    print(f"{case} dropout on: coupled {err:.2e}, plain accumulation {plain_err:.2e}")
    assert err <= TOL, err
    assert plain_err > 1e-2, plain_err


def test_clip_matches_clipmodel_return_loss():
    """The CLIP adapter's window loss is `CLIPModel(..., return_loss=True).loss` on the large batch, and its gradient
    (logit_scale included) is that loss's gradient."""
    torch.manual_seed(0)
    model, coupled, batches = CASES["clip"](0.0)
    big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    ref_model = __import__("copy").deepcopy(model)
    out = ref_model(**big, return_loss=True)
    out.loss.backward()
    ref = torch.cat([p.grad.reshape(-1) for p in ref_model.parameters()])
    got, window, result = coupled_gradient(model, coupled, batches)
    assert abs(float(window.loss) - out.loss.item()) <= 1e-6 * abs(out.loss.item())
    assert abs(result.loss - out.loss.item()) <= 1e-5 * abs(out.loss.item())  # the accumulator logs the window loss
    assert relative_error(got, ref) <= TOL
    names = [n for n, _ in model.named_parameters()]
    assert "logit_scale" in names and [p for p, _ in window.loss_parameter_grads][0] is not None
    ls = sum(p.numel() for n, p in model.named_parameters() if names.index(n) < names.index("logit_scale"))
    assert got[ls] != 0 and abs(float(got[ls] - ref[ls])) <= 1e-5 * abs(float(ref[ls]))


def test_rng_states_restored_exactly():
    """Every generator (torch, numpy, Python random) draws the same in pass 2 as in pass 1, and after the window the
    generators are where one pass would have left them."""
    draws = {1: [], 2: []}
    calls = []

    def embed(model, batch):
        calls.append(1)
        pass_no = 1 if len(calls) <= 2 else 2
        draws[pass_no].append((torch.rand(1).item(), float(np.random.rand()), random.random()))
        return model(batch) * (1 + torch.rand(batch.shape[0], 1))

    model = torch.nn.Linear(3, 2)
    # Every micro-batch recomputed in pass 2 (micro-batch 0's kept graph is tested on its own below).
    coupled = CoupledLoss(embed, lambda r, m: r.pow(2).mean(), check_recompute=True, keep_first_graph=False)
    acc = GradientAccumulator(model, 2)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    coupled.accumulate_window(acc, model, [torch.randn(2, 3), torch.randn(3, 3)])
    after = (torch.rand(1).item(), float(np.random.rand()), random.random())
    assert draws[1] == draws[2]
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    torch.randn(2, 3), torch.randn(3, 3)
    for rows in (2, 3):  # what pass 1 drew, once
        torch.rand(1), np.random.rand(), random.random(), torch.rand(rows, 1)
    assert after == (torch.rand(1).item(), float(np.random.rand()), random.random())


def test_item_loss_terms_keep_item_weighting():
    """An ordinary item-mean term added to the coupled loss is weighted by items, as in the large batch."""
    torch.manual_seed(0)
    model = TwoTower(dropout=0.0)
    batches = generic_batches()
    item_loss = lambda batch, reps: reps["q"].pow(2).sum(1).mean()  # noqa: E731
    coupled = generic_coupled(model, item_loss_fn=item_loss)
    got, window, result = coupled_gradient(model, coupled, batches)
    ref_model = __import__("copy").deepcopy(model)
    big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    reps = coupled.embed_fn(ref_model, big)
    total = coupled.loss_fn(reps, ref_model) + item_loss(big, reps)
    total.backward()
    ref = torch.cat([p.grad.reshape(-1) for p in ref_model.parameters()])
    assert relative_error(got, ref) <= TOL
    assert abs(result.loss - total.item()) <= 1e-5 * abs(total.item())


def test_multiple_windows_train_like_large_batch():
    """Two optimizer steps with SGD: the weights equal the large-batch run's (dropout off)."""
    torch.manual_seed(0)
    model = TwoTower(dropout=0.0)
    ref_model = __import__("copy").deepcopy(model)
    coupled = generic_coupled(model)
    ref_coupled = generic_coupled(ref_model)
    acc = GradientAccumulator(model, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    for seed in range(2):
        batches = generic_batches(seed=seed)
        coupled.accumulate_window(acc, model, batches)
        acc.step(opt)
        big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        ref_coupled.window_loss(ref_model, [big]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
    assert (got - ref).norm() <= TOL * ref.norm()


def test_fp16_loss_scaling_recompute_is_exact():
    """fp16 loss scaling with an overflow at the first micro-batch: the micro-batch is recomputed (RNG restored
    again), and the gradient is still the large-batch one (dropout on)."""
    torch.manual_seed(3)
    model, coupled, batches = CASES["generic"](0.1, check_recompute=True)
    scaler = DynamicLossScaler(init_scale=2.0**127)  # overflows in fp32 too: forces backoffs
    got, window, result = coupled_gradient(model, coupled, batches, loss_scaler=scaler, max_recompute_attempts=20)
    assert result.recomputed_micro_batches >= 1
    ref = reference_gradient(model, coupled, batches, window.rng_states)
    assert relative_error(got, ref) <= TOL


def test_bf16_autocast_runs_and_is_close():
    """bf16 autocast: the coupled mode runs under autocast and lands near the fp32 large batch (bf16 rounding)."""
    torch.manual_seed(0)
    model, coupled, batches = CASES["generic"](0.0)
    ref = reference_gradient(model, coupled, batches, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _, _ = coupled_gradient(model, coupled, batches)
    assert relative_error(got, ref) < 5e-2


def test_error_discards_window_and_restores_rng():
    model = torch.nn.Linear(3, 2)
    calls = []

    def embed(model, batch):
        calls.append(1)
        if len(calls) == 4:  # in pass 2, second micro-batch
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return model(batch)

    coupled = CoupledLoss(embed, lambda r, m: r.pow(2).mean())
    acc = GradientAccumulator(model, 3)
    torch.manual_seed(0)
    batches = [torch.randn(2, 3) for _ in range(3)]
    state = capture_rng_state()
    with pytest.raises(RuntimeError, match="allocate"):
        coupled.accumulate_window(acc, model, batches)
    assert acc.micro_steps_in_window == 0
    now = capture_rng_state()
    assert torch.equal(now.torch_cpu, state.torch_cpu)
    restore_rng_state(state)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="embed_fn"):
        CoupledLoss(None, lambda r, m: r)
    with pytest.raises(ValueError, match="gather_across_ranks"):
        CoupledLoss(lambda m, b: b, lambda r, m: r, gather_across_ranks="yes")
    model = torch.nn.Linear(3, 2)
    coupled = CoupledLoss(lambda m, b: m(b), lambda r, m: r.pow(2).mean())
    acc = GradientAccumulator(model, 2)
    acc.backward(model(torch.randn(2, 3)).sum(), 2)
    with pytest.raises(RuntimeError, match="start of a window"):
        coupled.accumulate_window(acc, model, [torch.randn(2, 3)])
    acc.discard_window()
    with pytest.raises(ValueError, match="micro-batches given"):
        coupled.accumulate_window(acc, model, [torch.randn(2, 3)] * 3)
    with pytest.raises(ValueError, match="scalar"):
        CoupledLoss(lambda m, b: m(b), lambda r, m: r).accumulate_window(acc, model, [torch.randn(2, 3)])


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_micro_batch_graph_kept_from_pass_one(case):
    """`keep_first_graph` (the default): micro-batch 0 is embedded once, with its graph, and the window's gradient is
    the one of recomputing it (dropout ON, same RNG), within 1e-6 relative; every other micro-batch is recomputed."""
    calls = []
    grads = {}
    for keep in (False, True):
        torch.manual_seed(1)
        model, coupled, batches = CASES[case](0.1, check_recompute=True, keep_first_graph=keep)
        embed = coupled.embed_fn
        coupled.embed_fn = lambda m, b, embed=embed, keep=keep: calls.append(keep) or embed(m, b)
        torch.manual_seed(2)
        grads[keep], window, _ = coupled_gradient(model, coupled, batches)
        assert window.first_graph is None  # dropped once used
    assert calls.count(False) == 2 * len(batches) and calls.count(True) == 2 * len(batches) - 1
    assert relative_error(grads[True], grads[False]) <= 1e-6
