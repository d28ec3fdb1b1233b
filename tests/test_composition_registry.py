"""The composition registry (`hf_gradaccum/integrations/registry.py`): one table of how each composed trainer and loss
accumulates, kept in step with the feature slices that carry it out, and what happens to a composition it does not
know. TRL's `CPOTrainer` (in `trl.experimental`) stands in for a real unknown trainer, with its registry rows and its
per-term weighting taken away for those tests (`cpo_unknown`): its loss is a mean over pairs plus `cpo_alpha` times a
token mean of the chosen completions' NLL, so with `cpo_alpha=0` accumulation by pairs is exact, and with the default
`cpo_alpha=1` it is not without a weight per term (the NLL's token mean is a statistic of the micro-batch).
One SGD(lr=1) step at b = 4, K = 3, fp32, against the stock trainer at GA = 1 with b x K; tolerance 1e-5 relative."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("trl")

from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

from hf_gradaccum import GradAccumFields, GradAccumTrainer  # noqa: E402
from hf_gradaccum.cli import main as cli_main  # noqa: E402
from hf_gradaccum.integrations import registry as compositions  # noqa: E402
from hf_gradaccum.integrations.registry import (  # noqa: E402
    HOW,
    REGISTRY,
    CompositionError,
    composition_table,
    register_composition,
    unknown_composed_trainer,
)
from hf_gradaccum.integrations.trl import loss_terms as trl_loss_terms  # noqa: E402
from hf_gradaccum.integrations.trl.grpo import LOSS_ITEMS  # noqa: E402
from hf_gradaccum.verification.windows import concat_window, cut  # noqa: E402
from tests.composition_cases import TRAIN_ARGS, flat_trainable, tiny_llama, word_tokenizer  # noqa: E402
from tests.test_composition import _preference_dataset  # noqa: E402

RTOL = 1e-5
B, K = 4, 3
CHECK_FILE = "accumulation_check.json"


@dataclasses.dataclass
class GradAccumCPOConfig(GradAccumFields, CPOConfig):
    pass


class GradAccumFirstCPO(GradAccumTrainer, CPOTrainer):
    pass


class CPOFirstGradAccum(CPOTrainer, GradAccumTrainer):
    pass


ORDERS = {"gradaccum_first": GradAccumFirstCPO, "cpo_first": CPOFirstGradAccum}


@pytest.fixture
def cpo_unknown(monkeypatch):
    """CPOTrainer as a trainer the registry does not know: no rows, no per-term weighting."""
    for key in [key for key in REGISTRY if key[0] == "CPOTrainer"]:
        monkeypatch.delitem(REGISTRY, key)
    terms = tuple(term for term in trl_loss_terms.LOSS_TERMS if term.trainer != "CPOTrainer")
    monkeypatch.setattr(trl_loss_terms, "LOSS_TERMS", terms)
    monkeypatch.setattr(compositions, "LOSS_TERMS", terms)


def _trainer(cls, output_dir, *, ga: int, batch: int, cpo_alpha: float, **options):
    torch.manual_seed(0)
    # One optimizer step on the first b x K samples.
    settings = {**TRAIN_ARGS, "max_steps": 1, "per_device_train_batch_size": batch, "gradient_accumulation_steps": ga}
    args = GradAccumCPOConfig(str(output_dir), cpo_alpha=cpo_alpha, bf16=False, **settings, **options)
    return cls(
        model=tiny_llama(),
        args=args,
        train_dataset=_preference_dataset(B * K),
        processing_class=word_tokenizer(),
    )


def _update(trainer) -> torch.Tensor:
    initial = flat_trainable(trainer.model)
    trainer.train()
    return flat_trainable(trainer.model) - initial


def _relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


def test_registry_rows_are_well_formed_and_follow_the_feature_tables():
    for (trainer, loss), entry in REGISTRY.items():
        assert entry.how in HOW, (trainer, loss)
        assert entry.what, (trainer, loss)
        assert (entry.how == "refused") == bool(entry.fix), (trainer, loss)
    for (trainer, loss_type), items in LOSS_ITEMS.items():
        assert REGISTRY[trainer, loss_type or "*"].how == "items"
        assert REGISTRY[trainer, loss_type or "*"].what.startswith(items.items)
    for loss in (*compositions.EMBEDDING_LOSSES, *compositions.GUIDED_LOSSES):
        row_mean = loss in compositions.ROW_MEAN_EMBEDDING_LOSSES
        assert REGISTRY["SentenceTransformerTrainer", loss].how == ("items" if row_mean else "coupled")
    for loss in compositions.REPLAYED_LOSSES:
        assert REGISTRY["SparseEncoderTrainer", loss].how == "coupled"
    for loss in compositions.MULTI_VECTOR_LOSSES:
        assert REGISTRY["MultiVectorEncoderTrainer", loss].how == "coupled"
    for cached, plain in compositions.CACHED_LOSSES.items():
        trainer = compositions.CACHED_LOSS_TRAINERS.get(cached, "SentenceTransformerTrainer")
        entry = REGISTRY[trainer, cached]
        if cached in compositions.CACHED_COUPLED_LOSSES:
            assert entry.how == "coupled"
        else:
            assert entry.how == "refused" and plain in entry.fix
    for trainer in compositions.SENTENCE_TRANSFORMERS_TRAINERS:
        assert REGISTRY[trainer, "*"].how == "items"


def test_cli_lists_every_registry_row(capsys):
    assert cli_main(["compositions"]) == 0
    table = capsys.readouterr().out
    assert table == composition_table() + "\n"
    lines = table.splitlines()
    assert lines[0] == "| trainer | loss | accumulates by | what |" and len(lines) == 2 + len(REGISTRY)
    assert (
        "| DPOTrainer | aot | window statistic |" in table
        and "| GRPOTrainer | bnpo | items | completion tokens" in table
    )


def test_only_third_party_trainers_the_registry_does_not_know_are_unknown_compositions(cpo_unknown):
    class Mine(GradAccumTrainer):  # the user's own subclass: their loss, not a composition
        pass

    for cls, expected in [
        (GradAccumTrainer, None),
        (Mine, None),
        (GradAccumFirstCPO, "CPOTrainer"),
        (CPOFirstGradAccum, "CPOTrainer"),
    ]:
        assert unknown_composed_trainer(cls.__new__(cls)) == expected, cls.__name__


def test_per_row_lists_are_cut_with_the_rows():
    batches = [
        {"prompt": ["a", "b"], "input_ids": torch.tensor([[1], [2]]), "mode": "x"},
        {"prompt": ["c"], "input_ids": torch.tensor([[3]]), "mode": "x"},
    ]
    rows, sizes = concat_window(batches)
    assert rows["prompt"] == ["a", "b", "c"] and sizes == [2, 1]
    first, second = cut(rows, [1, 2])
    assert first["prompt"] == ["a"] and second["prompt"] == ["b", "c"] and second["mode"] == "x"
    assert second["input_ids"].tolist() == [[2], [3]]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unknown_exact_composition_is_checked_then_equals_the_large_batch(tmp_path, cpo_unknown):
    reference = _update(_trainer(CPOTrainer, tmp_path / "large", ga=1, batch=B * K, cpo_alpha=0.0))
    for order, cls in ORDERS.items():
        out = tmp_path / order
        update = _update(_trainer(cls, out, ga=K, batch=B, cpo_alpha=0.0))
        error = _relative(update, reference)
        print(f"CPO cpo_alpha=0, {order}: relative update difference {error:.2e}")
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"
        with open(os.path.join(out, CHECK_FILE)) as f:
            assert json.load(f)["passed"] is True


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unknown_composition_that_is_not_exact_stops_before_the_first_optimizer_step(tmp_path, cpo_unknown):
    reference = _update(_trainer(CPOTrainer, tmp_path / "large", ga=1, batch=B * K, cpo_alpha=1.0))
    stock = _update(_trainer(CPOTrainer, tmp_path / "stock", ga=K, batch=B, cpo_alpha=1.0))
    # What the check protects against: stock accumulation is measurably off here.
    print(f"CPO cpo_alpha=1, stock at GA={K}: relative update difference {_relative(stock, reference):.2e}")
    assert _relative(stock, reference) > 1e-3
    for order, cls in ORDERS.items():
        trainer = _trainer(cls, tmp_path / order, ga=K, batch=B, cpo_alpha=1.0)
        before = flat_trainable(trainer.model)
        with pytest.raises(CompositionError) as error:
            trainer.train()
        message = str(error.value)
        print(f"{order}:\n{message}")
        assert (
            "CPOTrainer" in message and "'sigmoid'" in message and "Stopped before the first optimizer step" in message
        )
        assert "gradient_accumulation_steps=1" in message and "check_unknown_compositions=False" in message
        assert torch.equal(flat_trainable(trainer.model), before), f"{order}: weights changed"
        assert trainer.state.global_step == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_check_can_be_turned_off_and_registered_compositions_skip_it(tmp_path, monkeypatch, cpo_unknown):
    off = _trainer(GradAccumFirstCPO, tmp_path / "off", ga=K, batch=B, cpo_alpha=1.0, check_unknown_compositions=False)
    assert float(_update(off).norm()) > 0
    assert not os.path.exists(tmp_path / "off" / CHECK_FILE)

    monkeypatch.setitem(REGISTRY, ("CPOTrainer", "*"), REGISTRY["DPOTrainer", "*"])
    registered = _trainer(GradAccumFirstCPO, tmp_path / "registered", ga=K, batch=B, cpo_alpha=0.0)
    assert unknown_composed_trainer(registered) is None
    _update(registered)
    assert not os.path.exists(tmp_path / "registered" / CHECK_FILE)


def test_registered_refusal_stops_construction_and_bad_registrations_are_named(tmp_path, monkeypatch, cpo_unknown):
    monkeypatch.setattr(compositions, "REGISTRY", dict(REGISTRY))
    register_composition("CPOTrainer", "sigmoid", "refused", "a reason", "a fix")
    with pytest.raises(CompositionError, match="CPOTrainer.*'sigmoid' a reason.*a fix"):
        _trainer(GradAccumFirstCPO, tmp_path, ga=K, batch=B, cpo_alpha=1.0)
    with pytest.raises(ValueError, match="`how` must be 'items' or 'refused'"):
        register_composition("CPOTrainer", "*", "coupled", "x")
    with pytest.raises(ValueError, match="needs `fix`"):
        register_composition("CPOTrainer", "*", "refused", "x")
