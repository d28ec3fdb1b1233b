"""The in-place accumulation path (`engine/in_place.py`): autograd accumulates `.grad` itself, each loss weighted by
its items, no hook. Exactness against the hand-computed large batch (rtol 1e-5, fp32) and against the hook path,
which parameters keep `.grad = None`, when the path applies, and the loud refusals of what it cannot see."""

import copy

import pytest
import torch

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator
from hf_gradaccum.engine.loss_scaling import DynamicLossScaler
from tests.parity_cases import CASES, large_batch_reference, relative_update_error
from tests.test_accumulator import _plain_loop

RTOL = 1e-5
CASE_BY_NAME = {c.name: c for c in CASES}


@pytest.mark.parametrize("name", ["bert_seq_cls", "gpt2_causal_lm", "resnet_groupnorm_image_cls"])
def test_in_place_path_matches_large_batch_and_the_hook_path(name):
    case = CASE_BY_NAME[name]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(17, torch.Generator().manual_seed(3))
    micro_sizes, steps = [5, 1, 4, 7], 3  # windows [5, 1, 4] and a partial [7]
    in_place, acc = _plain_loop(case, model, data, micro_sizes, steps, path="in_place")
    hooks, hook_acc = _plain_loop(case, model, data, micro_sizes, steps, path="hooks")
    assert acc.in_place and not hook_acc.in_place
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())  # none left behind on the copy
    reference = large_batch_reference(case, model, data, [list(range(10)), list(range(10, 17))])
    err = relative_update_error(model, in_place, reference)
    err_hooks = relative_update_error(model, hooks, in_place)
    print(f"in-place {name}: vs large batch {err:.2e}, vs hook path {err_hooks:.2e}")
    assert err <= RTOL and err_hooks <= RTOL
    assert acc.applied_steps == 2


def test_no_hook_is_registered_and_grad_accumulates_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    acc = GradientAccumulator(model, 3)
    assert acc.in_place and all(getattr(p, "_post_accumulate_grad_hooks", None) is None for p in model.parameters())
    acc.backward(model(torch.randn(3, 4)).sum(), num_items=3)
    first = [p.grad for p in model.parameters()]
    acc.backward(model(torch.randn(2, 4)).sum(), num_items=2)
    assert all(
        p.grad is g for p, g in zip(model.parameters(), first, strict=True)
    )  # autograd added into the same tensors


def test_unused_parameters_keep_no_gradient_and_adamw_leaves_them_as_the_large_batch_does():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    torch.nn.functional.mse_loss(reference["used"](x), y, reduction="sum").div(6).backward()
    opt.step()

    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=0.1, weight_decay=0.5)
    acc = GradientAccumulator(trained, 2)
    for rows in (slice(0, 4), slice(4, 6)):
        n = rows.stop - rows.start
        acc.backward(torch.nn.functional.mse_loss(trained["used"](x[rows]), y[rows], reduction="sum") / n, num_items=n)
    acc.step(opt)
    assert torch.equal(trained["unused"].weight, model["unused"].weight)  # no `.grad`: AdamW skipped it
    err = relative_update_error(model, trained, reference)
    assert err <= RTOL, err


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"model_dtype": torch.bfloat16}, "torch.bfloat16"),
        ({"loss_scaler": True}, "fp16 loss scaling"),
        ({"offload_accumulation_buffer": True}, "offload_accumulation_buffer"),
        ({"accumulation_dtype": "float64"}, "accumulation dtype torch.float64"),
    ],
)
def test_auto_takes_the_hook_path_where_in_place_is_not_exact_and_in_place_says_why(kwargs, reason):
    kwargs = dict(kwargs)
    model = torch.nn.Linear(2, 2).to(kwargs.pop("model_dtype", torch.float32))
    if kwargs.pop("loss_scaler", False):
        kwargs["loss_scaler"] = DynamicLossScaler()
    assert not GradientAccumulator(model, 2, **kwargs).in_place
    with pytest.raises(ValueError, match=reason):
        GradientAccumulator(model, 2, accumulation_path="in_place", **kwargs)


def test_bad_accumulation_path_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"`accumulation_path` must be one of \('auto', 'hooks', 'in_place'\)"):
        GradientAccumulator(torch.nn.Linear(2, 2), 2, accumulation_path="fast")
    with pytest.raises(ValueError, match="accumulation_path"):
        GradAccumArguments("out", use_cpu=True, report_to=[], accumulation_path="fast")


def test_raw_backward_inside_a_micro_batch_is_refused_and_the_window_discarded():
    model = torch.nn.Linear(2, 1)
    acc = GradientAccumulator(model, 2)
    acc.begin_micro_batch(num_items=3)
    model(torch.randn(3, 2)).mean().backward()  # unweighted: the item weight rides on `loss_to_backward`
    with pytest.raises(RuntimeError, match="loss_to_backward"):
        acc.end_micro_batch(torch.zeros(()))
    assert acc.micro_steps_in_window == 0 and model.weight.grad is None


@pytest.mark.parametrize("how", ["raw_backward", "zero_grad_set_to_none", "zero_grad_in_place"])
def test_grad_changed_between_micro_batches_is_refused(how):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model)
    acc = GradientAccumulator(model, 3)
    acc.backward(model(torch.randn(2, 2)).sum(), num_items=2)
    if how == "raw_backward":
        model(torch.randn(2, 2)).sum().backward()
    else:
        optimizer.zero_grad(set_to_none=how == "zero_grad_set_to_none")
    with pytest.raises(RuntimeError, match="changed between the accumulator's micro-batches"):
        acc.backward(model(torch.randn(2, 2)).sum(), num_items=2)
    # Also at the window's end, when the change comes after the last micro-batch.
    acc.backward(model(torch.randn(2, 2)).sum(), num_items=2)
    model(torch.randn(2, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="changed between"):
        acc.step(optimizer)
    assert torch.equal(model.weight, before.weight)


def test_zero_item_micro_batch_and_non_finite_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    before = copy.deepcopy(model)
    x = torch.randn(4, 3)
    acc = GradientAccumulator(model, 3)
    acc.backward(model(x[:2]).sum() / 2, num_items=2)
    acc.backward(model(x[2:]).sum() * float("nan"), num_items=0)  # no items: weighs nothing
    acc.backward(model(x[2:]).sum() / 2, num_items=2)
    result = acc.finish_window()
    reference = copy.deepcopy(before)
    (reference(x).sum() / 4).backward()
    assert result.applied and torch.allclose(model.weight.grad, reference.weight.grad, rtol=RTOL, atol=0)

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer.zero_grad()
    weights = model.weight.detach().clone()
    acc.backward(model(x[:2]).sum() * float("inf"), num_items=2)
    result = acc.step(optimizer)
    assert not result.applied and result.skip_reason == "non_finite_loss"
    assert torch.equal(model.weight, weights) and model.weight.grad is None


def test_mid_window_checkpoint_resumes_exactly_and_refuses_the_other_path():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    xs = [torch.randn(n, 3) for n in (2, 3, 1)]

    def micro(m, a, x):
        a.backward(m(x).sum() / len(x), num_items=len(x))

    straight = copy.deepcopy(model)
    acc = GradientAccumulator(straight, 3)
    for x in xs:
        micro(straight, acc, x)
    acc.finish_window()

    first = copy.deepcopy(model)
    acc = GradientAccumulator(first, 3)
    micro(first, acc, xs[0])
    state = acc.state_dict()
    resumed = copy.deepcopy(model)
    acc = GradientAccumulator(resumed, 3)
    acc.load_state_dict(state)
    for x in xs[1:]:
        micro(resumed, acc, x)
    acc.finish_window()
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(ValueError, match="in-place path"):
        GradientAccumulator(copy.deepcopy(model), 3, accumulation_path="hooks").load_state_dict(state)


def test_trainer_uses_the_in_place_path_in_fp32_without_a_grad_scaler(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(8, torch.Generator().manual_seed(1))
    args = GradAccumArguments(
        str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_steps=2, save_strategy="steps",
        save_steps=2, weight_decay=0.0, max_grad_norm=0.0, dataloader_drop_last=False, seed=0,
    )  # fmt: skip
    trainer = GradAccumTrainer(model=copy.deepcopy(model), args=args, train_dataset=data)
    trainer.train()
    assert trainer.accumulator.in_place and trainer.accelerator.scaler is None
    assert not (tmp_path / "checkpoint-2" / "scaler.pt").exists()  # the stock Trainer's checkpoint files
