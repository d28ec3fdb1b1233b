"""Accumulation plans: exact splits of a target batch size, and the OOM halving chain."""

from __future__ import annotations

import logging

import pytest

from hf_gradaccum.helpers.planning import AccumulationPlan, CannotShrinkMicroBatchError, plan_accumulation


def check_exact(plan: AccumulationPlan, target: int) -> None:
    assert plan.effective_batch_size == target
    assert plan.micro_batch_size * plan.gradient_accumulation_steps * plan.world_size == target


@pytest.mark.parametrize(
    ("target", "kwargs", "expected"),
    [
        (64, {}, (64, 1, 1)),
        (64, {"micro_batch_size": 8}, (8, 8, 1)),
        (64, {"max_micro_batch_size": 8}, (8, 8, 1)),
        (64, {"max_micro_batch_size": 100}, (64, 1, 1)),
        (256, {"world_size": 2, "max_micro_batch_size": 48}, (32, 4, 2)),
        (96, {"max_micro_batch_size": 40}, (32, 3, 1)),
        (96, {"world_size": 4, "max_micro_batch_size": 5}, (4, 6, 4)),
        (96, {"micro_batch_size": 12}, (12, 8, 1)),
        (96, {"micro_batch_size": 24, "world_size": 4}, (24, 1, 4)),
        (30, {"max_micro_batch_size": 4}, (3, 10, 1)),
        (1, {}, (1, 1, 1)),
    ],
)
def test_exact_plans(target, kwargs, expected):
    plan = plan_accumulation(target, **kwargs)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.world_size) == expected
    check_exact(plan, target)


def test_every_plan_is_exact():
    for target in range(1, 97):
        for world_size in (1, 2, 3, 4):
            if target % world_size:
                continue
            for max_micro in (None, 1, 5, 8, 16):
                plan = plan_accumulation(target, world_size=world_size, max_micro_batch_size=max_micro)
                check_exact(plan, target)
                if max_micro is not None:
                    assert plan.micro_batch_size <= max_micro


def test_prime_share_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_gradaccum.helpers.planning"):
        plan = plan_accumulation(97, max_micro_batch_size=32)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (1, 97)
    assert "divisors" in caplog.text


def test_impossible_plans_raise_clear_errors():
    with pytest.raises(ValueError, match=r"`target_batch_size=100` must be divisible by `world_size=8`.*96, 104"):
        plan_accumulation(100, world_size=8)
    with pytest.raises(ValueError, match=r"`micro_batch_size=7` must divide .* 64.*\[1, 2, 4, 8, 16, 32, 64\]"):
        plan_accumulation(64, micro_batch_size=7)
    with pytest.raises(ValueError, match=r"`micro_batch_size=32` must divide .* = 16"):
        plan_accumulation(64, micro_batch_size=32, world_size=4)
    with pytest.raises(ValueError, match="exceeds `max_micro_batch_size=8`"):
        plan_accumulation(64, micro_batch_size=16, max_micro_batch_size=8)
    for kwargs, name in [
        ({"target_batch_size": 0}, "target_batch_size"),
        ({"target_batch_size": 64.0}, "target_batch_size"),
        ({"target_batch_size": 64, "world_size": 0}, "world_size"),
        ({"target_batch_size": 64, "micro_batch_size": -8}, "micro_batch_size"),
        ({"target_batch_size": 64, "max_micro_batch_size": 0}, "max_micro_batch_size"),
    ]:
        with pytest.raises(ValueError, match=f"`{name}` must be an integer >= 1"):
            plan_accumulation(**kwargs)
    with pytest.raises(ValueError, match="effective_batch_size"):
        AccumulationPlan(micro_batch_size=8, gradient_accumulation_steps=2, world_size=1, effective_batch_size=15)


def test_halved_chain_keeps_effective_batch():
    plan = plan_accumulation(64, micro_batch_size=32)
    chain = [(plan.micro_batch_size, plan.gradient_accumulation_steps)]
    while plan.micro_batch_size > 1:
        plan = plan.halved()
        check_exact(plan, 64)
        chain.append((plan.micro_batch_size, plan.gradient_accumulation_steps))
    assert chain == [(32, 2), (16, 4), (8, 8), (4, 16), (2, 32), (1, 64)]
    with pytest.raises(CannotShrinkMicroBatchError, match="below 1 sample"):
        plan.halved()
    assert issubclass(CannotShrinkMicroBatchError, RuntimeError)


def test_halved_odd_micro_batch_uses_largest_divisor_at_most_half():
    # 5 x 8 = 40: 2.5 is impossible, 2 is the largest divisor of 40 that is <= 2.
    plan = plan_accumulation(80, micro_batch_size=5, world_size=2).halved()
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.world_size) == (2, 20, 2)
    check_exact(plan, 80)
    # 15 x 4 = 60 -> 6 x 10 (7 does not divide 60).
    plan = plan_accumulation(60, micro_batch_size=15).halved()
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (6, 10)
    # 3 x 1 = 3 -> 1 x 3.
    plan = plan_accumulation(3).halved()
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (1, 3)
