"""Learning-rate scaling rules, warmup heuristic and effective batch size."""

from __future__ import annotations

import math

import pytest

from hf_gradaccum.helpers.lr_scaling import (
    LR_SCALING_RULES,
    effective_batch_size,
    lr_scaling_factor,
    recommended_warmup_steps,
    scale_learning_rate,
)


@pytest.mark.parametrize(
    ("base_lr", "base", "new", "rule", "expected"),
    [
        (1e-3, 32, 256, "linear", 8e-3),  # Goyal et al.: lr * 256 / 32
        (0.1, 256, 8192, "linear", 3.2),
        (0.1, 256, 128, "linear", 0.05),  # smaller batches scale down too
        (1e-3, 32, 128, "sqrt", 2e-3),  # Malladi et al.: lr * sqrt(4)
        (1e-3, 128, 32, "sqrt", 5e-4),
        (1e-3, 32, 256, "none", 1e-3),
        (3e-4, 64, 64, "linear", 3e-4),
    ],
)
def test_scaling_rules_exact_values(base_lr, base, new, rule, expected):
    lr = scale_learning_rate(base_lr, base_batch_size=base, new_batch_size=new, rule=rule)
    assert math.isclose(lr, expected, rel_tol=1e-15)


def test_default_rule_is_linear_and_factor_matches():
    assert scale_learning_rate(1e-3, base_batch_size=32, new_batch_size=256) == 1e-3 * 8
    assert LR_SCALING_RULES == ("linear", "sqrt", "none")
    assert lr_scaling_factor(base_batch_size=10, new_batch_size=40, rule="sqrt") == 2.0
    assert lr_scaling_factor(base_batch_size=10, new_batch_size=40, rule="none") == 1.0


@pytest.mark.parametrize("rule", ["quadratic", "Linear", "", None])
def test_unknown_rule_names_argument_and_choices(rule):
    with pytest.raises(ValueError, match=r"`rule` must be one of \('linear', 'sqrt', 'none'\)"):
        scale_learning_rate(1e-3, base_batch_size=32, new_batch_size=64, rule=rule)


@pytest.mark.parametrize("bad", [0, -32, 32.0, 2.5, True, None, "32"])
@pytest.mark.parametrize("argument", ["base_batch_size", "new_batch_size"])
def test_invalid_batch_sizes_name_the_argument(argument, bad):
    kwargs = {"base_batch_size": 32, "new_batch_size": 64, argument: bad}
    with pytest.raises(ValueError, match=f"`{argument}` must be an integer >= 1"):
        scale_learning_rate(1e-3, **kwargs)


@pytest.mark.parametrize("bad", [0, 0.0, -1e-3, math.inf, math.nan, None, True, "1e-3"])
def test_invalid_learning_rate_names_the_argument(bad):
    with pytest.raises(ValueError, match="`base_lr` must be a finite number > 0"):
        scale_learning_rate(bad, base_batch_size=32, new_batch_size=64)


def test_recommended_warmup_steps():
    # Goyal et al.: 5 epochs of warmup when the learning rate is scaled up.
    assert recommended_warmup_steps(base_batch_size=256, new_batch_size=8192, steps_per_epoch=157) == 785
    assert recommended_warmup_steps(base_batch_size=32, new_batch_size=64, steps_per_epoch=10, warmup_epochs=0.5) == 5
    assert recommended_warmup_steps(base_batch_size=32, new_batch_size=64, steps_per_epoch=3, warmup_epochs=0.5) == 2
    assert recommended_warmup_steps(base_batch_size=32, new_batch_size=128, steps_per_epoch=10, rule="sqrt") == 50
    # No increase, no warmup needed for the batch-size change.
    assert recommended_warmup_steps(base_batch_size=256, new_batch_size=256, steps_per_epoch=100) == 0
    assert recommended_warmup_steps(base_batch_size=256, new_batch_size=64, steps_per_epoch=100) == 0
    assert recommended_warmup_steps(base_batch_size=32, new_batch_size=256, steps_per_epoch=100, rule="none") == 0
    with pytest.raises(ValueError, match="`steps_per_epoch`"):
        recommended_warmup_steps(base_batch_size=32, new_batch_size=64, steps_per_epoch=0)
    with pytest.raises(ValueError, match="`warmup_epochs`"):
        recommended_warmup_steps(base_batch_size=32, new_batch_size=64, steps_per_epoch=10, warmup_epochs=-1)
    with pytest.raises(ValueError, match="`rule`"):
        recommended_warmup_steps(base_batch_size=32, new_batch_size=64, steps_per_epoch=10, rule="cosine")


def test_effective_batch_size():
    assert effective_batch_size(8, 4, 2) == 64
    assert effective_batch_size(8) == 8
    assert effective_batch_size(micro_batch_size=3, gradient_accumulation_steps=5, world_size=7) == 105
    for kwargs, name in [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": 8, "gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps"),
        ({"micro_batch_size": 8, "world_size": -2}, "world_size"),
    ]:
        with pytest.raises(ValueError, match=f"`{name}`"):
            effective_batch_size(**kwargs)
