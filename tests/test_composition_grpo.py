"""GradAccumTrainer composed with TRL's GRPOTrainer, in either class order, against the stock GRPOTrainer on one batch
of b x K: b = 4 completions per micro-batch, K = 3 accumulation steps, one SGD(lr=1) step on the same generations
(checked token by token), fp32, tolerance 1e-5 relative on the update. Every loss type averages over what
`hf_gradaccum/integrations/trl/grpo.py` says (sequences or completion tokens), so each equals the large batch, `bnpo`
included, which the stock trainer at GA = K does not (about 0.4 here; see the slow table,
`pytest tests/test_composition_grpo.py -m slow -s -k table`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.grpo_cases import (  # noqa: E402
    GRPO_ORDERS,
    RLOO_ORDERS,
    StockGRPO,
    StockRLOO,
    assert_same_generations,
    completion_length,
    grpo_args,
    low_words,
    relative_difference,
    rloo_args,
    train_grpo,
)

RTOL = 1e-5
B, K = 4, 3
FAST_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
SLOW_LOSS_TYPES = ["sapo", "cispo", "vespo", "luspo"]


def _large_batch(tmp_path, spg: int = K, **config) -> object:
    return train_grpo(StockGRPO, grpo_args(str(tmp_path / "large"), ga=1, batch=B * K, spg=spg // K, **config))


def _ours(tmp_path, order: str, spg: int = K, reward_funcs=(completion_length,), **config) -> object:
    args = grpo_args(str(tmp_path / order), ga=K, batch=B, spg=spg, **config)
    return train_grpo(GRPO_ORDERS[order], args, reward_funcs=reward_funcs)


def _check_both_orders(tmp_path, spg: int = K, reward_funcs=(completion_length,), **config) -> None:
    reference = train_grpo(
        StockGRPO, grpo_args(str(tmp_path / "large"), ga=1, batch=B * K, spg=spg // K, **config), reward_funcs
    )
    for order in GRPO_ORDERS:
        run = _ours(tmp_path, order, spg=spg, reward_funcs=reward_funcs, **config)
        assert_same_generations(run, reference)
        error = relative_difference(run.update, reference.update)
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"


@pytest.mark.parametrize("loss_type", FAST_LOSS_TYPES)
def test_every_loss_type_equals_the_large_batch(tmp_path, loss_type):
    _check_both_orders(tmp_path, loss_type=loss_type)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", SLOW_LOSS_TYPES)
def test_every_other_loss_type_equals_the_large_batch(tmp_path, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    _check_both_orders(tmp_path, loss_type=loss_type, **extra)


def test_bnpo_completion_lengths_differ_between_micro_batches(tmp_path):
    # The bnpo case above tests something only if the micro-batches hold different numbers of completion tokens.
    run = _ours(tmp_path, "gradaccum_first", loss_type="bnpo")
    mask = run.generations[0]["completion_mask"]
    assert len(set(mask.sum(1).tolist())) > 3


def test_two_reward_functions(tmp_path):
    _check_both_orders(
        tmp_path, reward_funcs=(completion_length, low_words), loss_type="bnpo", reward_weights=[1.0, 0.5]
    )


# A token mean beside the bonus's token mean; and a mean over sequences, where the bonus gets a weight of its own
# (`integrations/trl/loss_terms.py`).
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo"])
def test_entropy_bonus(tmp_path, loss_type):
    _check_both_orders(tmp_path, loss_type=loss_type, entropy_coef=0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_type", "level"), [("grpo", "token"), ("grpo", "sequence"), ("dapo", "token"), ("bnpo", "token")]
)
def test_generation_batch_spans_two_windows(tmp_path, loss_type, level):
    # steps_per_generation = 2K: the second window trains on completions sampled before the first update, so TRL's
    # importance ratios differ from 1 there (at token or sequence level).
    _check_both_orders(tmp_path, spg=2 * K, loss_type=loss_type, importance_sampling_level=level, max_steps=2)


@pytest.mark.slow
@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "sequence"), ("bnpo", "token"), ("dapo", "token")])
def test_num_iterations_two(tmp_path, loss_type, level):
    _check_both_orders(tmp_path, loss_type=loss_type, importance_sampling_level=level, num_iterations=2, max_steps=2)


def test_rloo_equals_the_large_batch(tmp_path):
    # RLOO's loss is a mean over sequences, as GRPO's `grpo`.
    reference = train_grpo(StockRLOO, rloo_args(str(tmp_path / "large"), ga=1, batch=B * K, spg=1))
    for order, cls in RLOO_ORDERS.items():
        run = train_grpo(cls, rloo_args(str(tmp_path / order), ga=K, batch=B))
        assert_same_generations(run, reference)
        error = relative_difference(run.update, reference.update)
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"loss_type": "grpo", "entropy_coef": 0.1, "spg": 2 * K}, "steps_per_generation"),
        ({"loss_type": "dr_grpo", "use_adaptive_entropy": True}, "use_adaptive_entropy=False"),
        ({"loss_type": "dapo", "top_entropy_quantile": 0.5, "spg": 2 * K}, "top_entropy_quantile=1.0"),
        ({"loss_type": "dapo", "entropy_coef": 0.1, "spg": 2 * K}, "steps_per_generation"),
    ],
)
def test_refuses_what_cannot_be_exact_before_training(tmp_path, config, needle):
    for cls in GRPO_ORDERS.values():
        args = grpo_args(str(tmp_path / "refused"), ga=K, batch=B, **config)  # spg given or K
        with pytest.raises(ValueError) as error:
            train_grpo(cls, args)
        message = str(error.value)
        assert "GRPOTrainer" in message and repr(config["loss_type"]) in message and needle in message


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_fp16_overflow_recomputes_the_same_micro_batch(tmp_path, loss_type):
    """fp16: the first micro-batch overflows at scale 2**40 and is recomputed at 2**10 on the completions its first
    forward saw (TRL has advanced to the next buffered micro-batch by then). The update equals, bit for bit, a run
    at 2**10 from the start, in both class orders."""
    from tests.composed_arguments import GradAccumGRPOConfig

    for order in GRPO_ORDERS:
        runs = {}
        for name, scaling in {
            "overflow": dict(loss_scale_init=2.0**40, loss_scale_backoff_factor=2.0**-30),
            "clean": dict(loss_scale_init=2.0**10),
        }.items():
            args = grpo_args(
                str(tmp_path / f"{order}_{name}"),
                ga=K,
                batch=B,
                config_cls=GradAccumGRPOConfig,
                loss_type=loss_type,
                fp16=True,
                **scaling,
            )
            runs[name] = train_grpo(GRPO_ORDERS[order], args)
        overflowed, clean = runs["overflow"].trainer.accumulator, runs["clean"].trainer.accumulator
        assert overflowed.recomputed_micro_batches == 1 and clean.recomputed_micro_batches == 0
        assert overflowed.applied_steps == clean.applied_steps == 1
        assert overflowed.loss_scaler.scale == clean.loss_scaler.scale == 2.0**10
        assert_same_generations(runs["overflow"], runs["clean"])
        error = relative_difference(runs["overflow"].update, runs["clean"].update)
        print(f"{order} {loss_type}: fp16 recompute vs a clean run at the same scale {error:.1e}")
        assert error == 0.0


@pytest.mark.slow
def test_grpo_error_table(tmp_path):
    """The measured table of docs/composition_rl.md: stock at GA = K and ours in both orders, against the large batch."""
    rows = []
    for loss_type in FAST_LOSS_TYPES + SLOW_LOSS_TYPES:
        extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
        reference = _large_batch(tmp_path, loss_type=loss_type, **extra)
        stock = train_grpo(StockGRPO, grpo_args(str(tmp_path / "stock"), ga=K, batch=B, loss_type=loss_type, **extra))
        assert_same_generations(stock, reference)
        errors = [relative_difference(stock.update, reference.update)]
        for order in GRPO_ORDERS:
            run = _ours(tmp_path, order, loss_type=loss_type, **extra)
            assert_same_generations(run, reference)
            errors.append(relative_difference(run.update, reference.update))
        rows.append((loss_type, *errors))
    reference = train_grpo(StockRLOO, rloo_args(str(tmp_path / "large"), ga=1, batch=B * K, spg=1))
    stock = train_grpo(StockRLOO, rloo_args(str(tmp_path / "stock"), ga=K, batch=B))
    errors = [relative_difference(stock.update, reference.update)]
    for order, cls in RLOO_ORDERS.items():
        run = train_grpo(cls, rloo_args(str(tmp_path / order), ga=K, batch=B))
        assert_same_generations(run, reference)
        errors.append(relative_difference(run.update, reference.update))
    rows.append(("RLOO", *errors))
    print("\n| loss_type | stock GA=3 | GradAccumTrainer first | GRPO/RLOO first |")
    for loss_type, *errors in rows:
        print(f"| {loss_type} | " + " | ".join(f"{e:.2g}" for e in errors) + " |")
    assert all(max(errors[1:]) <= RTOL for _, *errors in rows)
