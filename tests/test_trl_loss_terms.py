"""Losses of several terms and statistics of the batch (`integrations/trl/loss_terms.py`, `integrations/trl/dpo_sorted.py`,
`integrations/trl/grpo_entropy.py`): what the parity of the zoo (`tests/test_trl_zoo.py`) does not show. The trainer's
own settings are as configured after training (every lever is put back after each loss, the window pass leaves no
metrics of its own), the registry names each term, and nothing is installed where one term or one micro-batch
needs no weighting."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("trl")

from hf_gradaccum.integrations.registry import REGISTRY  # noqa: E402
from hf_gradaccum.integrations.trl import dpo_sorted as trl_dpo_sorted  # noqa: E402
from hf_gradaccum.integrations.trl import loss_terms as trl_loss_terms  # noqa: E402
from tests.trl_zoo_cases import CASES, COMMON, B, K, _load, _window, classes  # noqa: E402


def _case(name: str, variant: str):
    return next(c for c in CASES if c.name == name and c.variant == variant)


def _build(case, order: str, tmp_path, ga: int = K):
    config_cls = _load(case.config)
    window = (case.batch_settings or _window)(ga, B)
    args = config_cls(str(tmp_path / order), **{**COMMON, **case.settings, **window})
    return classes(case)[order](args=args, **case.build())


@pytest.mark.parametrize(
    ("name", "variant", "attribute"),
    [
        ("DPOTrainer", "sigmoid + sft (RPO)", "loss_weights"),
        ("CPOTrainer", "sigmoid", "cpo_alpha"),
        ("TPOTrainer", "tpo_alpha=1", "tpo_alpha"),
        ("GRPOTrainer", "grpo + entropy_coef", "entropy_coef"),
    ],
)
@pytest.mark.parametrize("order", ["gradaccum_first", "trl_first"])
def test_each_lever_is_put_back_after_training(tmp_path, name, variant, attribute, order):
    trainer = _build(_case(name, variant), order, tmp_path)
    assert isinstance(trainer._loss_terms, trl_loss_terms.WindowTermWeights), trainer._loss_terms
    before = getattr(trainer, attribute)
    before = list(before) if isinstance(before, list) else before
    trainer.train()
    after = getattr(trainer, attribute)
    assert (list(after) if isinstance(after, list) else after) == before
    # No instance attribute is left shadowing the trainer's own methods.
    assert not {"compute_loss", "concatenated_forward", "_compute_policy_loss", "get_high_entropy_mask"} & set(
        vars(trainer)
    )


def test_the_window_pass_leaves_no_trace_in_dpo(tmp_path):
    trainer = _build(_case("DPOTrainer", "aot, another reference"), "gradaccum_first", tmp_path)
    assert isinstance(trainer._sorted_loss, trl_dpo_sorted.WindowSortedLoss)
    loader = iter(trainer.get_train_dataloader())
    batches = [next(loader) for _ in range(K)]
    trainer.model.train()
    metrics, tokens = copy.deepcopy(trainer._metrics), trainer._total_train_tokens
    trainer._sorted_loss.window_prefetched(trainer, batches)
    assert trainer._metrics == metrics and trainer._total_train_tokens == tokens
    assert sys.modules["trl.trainer.dpo_trainer"].torch is torch
    # Each micro-batch's two sorted inputs (chosen and rejected log-ratios) over the window's pairs.
    ((chosen, rejected),) = trainer._sorted_loss._window
    assert chosen.shape == rejected.shape == (B * K,)


def test_nothing_is_weighted_per_term_where_the_terms_share_a_count_or_the_window_is_one_batch(tmp_path):
    assert _build(_case("DPOTrainer", "sigmoid"), "gradaccum_first", tmp_path)._loss_terms is None
    assert _build(_case("CPOTrainer", "hinge, cpo_alpha=0.0"), "gradaccum_first", tmp_path)._loss_terms is None
    assert _build(_case("GRPOTrainer", "dapo + entropy_coef"), "gradaccum_first", tmp_path)._loss_terms is None
    one_batch = _build(_case("DPOTrainer", "sigmoid + sft (RPO)"), "gradaccum_first", tmp_path, ga=1)
    assert one_batch._loss_terms is None and one_batch._sorted_loss is None


def test_every_term_has_a_registry_row_that_names_it():
    for term in trl_loss_terms.LOSS_TERMS:
        entry = REGISTRY[term.trainer, term.option]
        assert entry.how == "items" and term.items in entry.what and term.primary in entry.what, term
    for loss in trl_dpo_sorted.SORTED_LOSS_TYPES:
        assert REGISTRY["DPOTrainer", loss].how == "window statistic"
    assert REGISTRY["GRPOTrainer", "top_entropy_quantile"].how == "window statistic"
