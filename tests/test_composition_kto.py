"""GradAccumTrainer composed with TRL's KTOTrainer, in either class order, against the stock KTOTrainer at GA = 1 on
the same rows as one batch: one SGD(lr=1) step at b = 4, K = 3, fp32, tolerance 1e-5 relative.

`loss_type='kto'` compares each completion's log-ratio with a KL baseline estimated from mismatched (prompt,
completion) pairs, which TRL builds by rotating completions within each batch. The composed trainer builds them
within the window's b x K rows and computes one baseline over the window before its first micro-batch
(`hf_gradaccum/integrations/trl/kto.py`); the stock KTOTrainer at GA = K rotates within each micro-batch and uses each
micro-batch's own baseline, which is checked to be outside the tolerance (so the comparison can fail). The reference
model is initialised apart from the policy, so the baseline is far from 0 (and from TRL's clamp at 0).
`apo_zero_unpaired` (no KL term) is a mean over completions and equals the large batch too. BCO (removed before
trl 1.16) is refused by class name. The 2-process DDP case is `tests/test_composition_kto_ddp.py`."""

from __future__ import annotations

import pytest
import transformers

pytest.importorskip("trl")

from trl import KTOTrainer  # noqa: E402

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from tests.composed_arguments import GradAccumKTOConfig  # noqa: E402
from tests.composition_cases import tiny_llama, word_tokenizer  # noqa: E402
from tests.kto_cases import ORDERS, B, K, kto_dataset, train_kto  # noqa: E402

RTOL = 1e-5


def _relative(update, reference) -> float:
    return float((update - reference).norm() / reference.norm())


@pytest.fixture(scope="module")
def large_batch(tmp_path_factory):
    """The stock KTOTrainer at GA = 1 on the b x K rows as one batch."""
    return train_kto(KTOTrainer, str(tmp_path_factory.mktemp("large")), ga=1, batch=B * K, rows=B * K)


def test_kto_kl_baseline_equals_the_large_batch(tmp_path, large_batch):
    (large_kl,) = large_batch.kls
    stock = train_kto(KTOTrainer, str(tmp_path / "stock"), ga=K, batch=B, rows=B * K)
    stock_error = _relative(stock.update, large_batch.update)
    print(f"\nlarge batch (GA=1, {B * K} rows): KL {large_kl:.4f}")
    print(
        f"stock KTOTrainer GA={K}: KL per micro-batch {[round(v, 4) for v in stock.kls]}, rel. diff {stock_error:.2e}"
    )
    # Without the window's pairs and baseline the update is measurably different: the test can fail.
    assert stock_error > 100 * RTOL
    assert all(abs(kl - large_kl) > 1e-3 * large_kl for kl in stock.kls)
    for order, cls in ORDERS.items():
        run = train_kto(cls, str(tmp_path / order), ga=K, batch=B, rows=B * K)
        error = _relative(run.update, large_batch.update)
        print(f"{order} GA={K}: KL per micro-batch {[round(v, 4) for v in run.kls]}, rel. diff {error:.2e}")
        # Every micro-batch's loss used the large batch's baseline (TRL's `kl` metric records the one it used).
        assert run.kls == pytest.approx([large_kl] * K, rel=1e-6)
        assert run.trainer._kto_baseline.kl == pytest.approx(large_kl, rel=1e-6)
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"


def test_kto_with_class_weights_and_an_uneven_split_equals_the_large_batch(tmp_path):
    # Desirable rows per micro-batch: 2, 3, 3 (label = i % 3 != 0); each class's losses weighted differently.
    weights = {"desirable_weight": 1.5, "undesirable_weight": 0.6}
    reference = train_kto(KTOTrainer, str(tmp_path / "large"), ga=1, batch=B * K, rows=B * K, **weights)
    for order, cls in ORDERS.items():
        run = train_kto(cls, str(tmp_path / order), ga=K, batch=B, rows=B * K, **weights)
        error = _relative(run.update, reference.update)
        print(f"\n{order} GA={K}: KL {run.kls[0]:.4f} (one batch {reference.kls[0]:.4f}), rel. diff {error:.2e}")
        assert run.kls == pytest.approx(reference.kls * K, rel=1e-6)
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"


def test_kto_with_precomputed_reference_log_probs_equals_the_large_batch(tmp_path):
    # The reference's KL log-probabilities come from the dataset (`ref_KL_logps`), computed on the window's pairs.
    reference = train_kto(
        KTOTrainer, str(tmp_path / "large"), ga=1, batch=B * K, rows=B * K, precompute_ref_log_probs=True
    )
    for order, cls in ORDERS.items():
        run = train_kto(cls, str(tmp_path / order), ga=K, batch=B, rows=B * K, precompute_ref_log_probs=True)
        error = _relative(run.update, reference.update)
        print(f"\n{order} GA={K}: KL {run.kls[0]:.4f} (one batch {reference.kls[0]:.4f}), rel. diff {error:.2e}")
        assert run.kls == pytest.approx(reference.kls * K, rel=1e-6)
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"


def test_kto_without_kl_term_equals_the_large_batch(tmp_path):
    reference = train_kto(
        KTOTrainer, str(tmp_path / "large"), ga=1, batch=B * K, rows=B * K, loss_type="apo_zero_unpaired"
    )
    for order, cls in ORDERS.items():
        run = train_kto(cls, str(tmp_path / order), ga=K, batch=B, rows=B * K, loss_type="apo_zero_unpaired")
        error = _relative(run.update, reference.update)
        print(f"\n{order} GA={K} apo_zero_unpaired: rel. diff {error:.2e}")
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"


def _construct(cls, args) -> None:
    cls(
        model=tiny_llama(),
        ref_model=tiny_llama(),
        args=args,
        train_dataset=kto_dataset(8),
        processing_class=word_tokenizer(),
    )


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"verify_accumulation": "first_step"}, "verify_accumulation"),
    ],
)
def test_kto_kl_baseline_refusals_name_the_option(tmp_path, config, names):
    config_cls = GradAccumKTOConfig
    for order, cls in ORDERS.items():
        args = config_cls(
            str(tmp_path / order),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            loss_type="kto",
            train_sampling_strategy="sequential",
            use_cpu=True,
            report_to=[],
            **config,
        )
        with pytest.raises(ValueError, match=names) as error:
            _construct(cls, args)
        assert "KTOTrainer" in str(error.value) and "'kto'" in str(error.value)


class BCOTrainer(transformers.Trainer):
    """A stand-in named as TRL's BCOTrainer (removed before trl 1.16, so the real one cannot be imported here)."""


def test_bco_is_refused_by_name_under_accumulation(tmp_path):
    class Composed(GradAccumTrainer, BCOTrainer):
        pass

    def args(ga: int) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            str(tmp_path), gradient_accumulation_steps=ga, use_cpu=True, report_to=[]
        )

    with pytest.raises(ValueError) as error:
        Composed(model=tiny_llama(), args=args(2))
    message = str(error.value)
    assert "BCOTrainer" in message and "running mean" in message and "gradient_accumulation_steps=1" in message
    Composed(model=tiny_llama(), args=args(1))  # nothing to accumulate: allowed
