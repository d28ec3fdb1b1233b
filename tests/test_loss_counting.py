"""Counting where the loss is (`hf_gradaccum/losses/counting.py`) and choosing registry rows by the nearest
library class (`losses/composed_class.py`): which trainers hand their loss the prefetched batch, which are unknown,
the logged loss when the loss sees other rows than were prefetched, and refusals instead of tracebacks. Exactness
itself is measured against the stock trainers in `tests/test_trl_zoo.py`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from transformers import Trainer  # noqa: E402
from trl import GRPOTrainer, SFTTrainer  # noqa: E402
from trl.experimental.gkd import GKDTrainer  # noqa: E402
from trl.experimental.gmpo import GMPOTrainer  # noqa: E402
from trl.experimental.gold import GOLDTrainer  # noqa: E402
from trl.experimental.sdpo import SDPOTrainer  # noqa: E402

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from hf_gradaccum.integrations.registry import CompositionError, unknown_composed_trainer  # noqa: E402
from hf_gradaccum.losses.composed_class import library_trainer  # noqa: E402
from hf_gradaccum.losses.counting import WindowLossLog, hands_batch_to_loss_unchanged  # noqa: E402
from tests.test_composition_registry import B, K, _trainer, cpo_unknown  # noqa: E402, F401 (a fixture)


def _composed(*bases: type) -> type:
    return type("Composed", bases, {})


@pytest.mark.parametrize("library", [GMPOTrainer, GKDTrainer, GOLDTrainer, SDPOTrainer])
def test_a_subclass_of_a_known_trainer_is_its_own_row(library):
    for bases in [(GradAccumTrainer, library), (library, GradAccumTrainer)]:
        cls = _composed(*bases)
        assert library_trainer(cls) is library
    unknown = unknown_composed_trainer(
        _composed(GradAccumTrainer, library).__new__(_composed(GradAccumTrainer, library))
    )
    # Each has a row of its own, by its own name: GMPO's is not GRPO's, GKD's and GOLD's are not SFT's.
    assert unknown is None


def test_only_pass_through_parents_reuse_the_prefetched_count():
    assert hands_batch_to_loss_unchanged(_composed(GradAccumTrainer, Trainer))
    assert hands_batch_to_loss_unchanged(_composed(SFTTrainer, GradAccumTrainer))
    # They generate or replace the rows before the loss.
    for library in (GKDTrainer, GOLDTrainer, GRPOTrainer, SDPOTrainer):
        assert not hands_batch_to_loss_unchanged(_composed(GradAccumTrainer, library)), library.__name__

    class Mine(GradAccumTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    assert not hands_batch_to_loss_unchanged(Mine)


def test_logged_share_sums_to_the_window_mean_whatever_was_counted_at_prefetch():
    losses, counted_at_loss = [2.0, 5.0, 1.0], [1, 3, 4]
    expected = sum(loss * n for loss, n in zip(losses, counted_at_loss, strict=True)) / sum(counted_at_loss)
    for prefetched in ([1, 3, 4], [2, 2, 2], None):
        log = WindowLossLog()
        log.start(None if prefetched is None else float(sum(prefetched)))
        total = sum(
            float(
                log.share(
                    torch.tensor(loss),
                    n,
                    None if prefetched is None else prefetched[k],
                    last=k == len(losses) - 1,
                    steps=len(losses),
                )
            )
            for k, (loss, n) in enumerate(zip(losses, counted_at_loss, strict=True))
        )
        assert total == pytest.approx(expected, rel=1e-6), prefetched


class BrokenLoss:
    """A composed loss that fails (as a trainer whose batch the check cannot handle does)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")


@pytest.mark.usefixtures("cpo_unknown")
def test_any_exception_inside_the_first_window_check_is_a_refusal(tmp_path):
    from trl.experimental.cpo import CPOTrainer

    cls = type("BrokenFirstCPO", (BrokenLoss, GradAccumTrainer, CPOTrainer), {})
    trainer = _trainer(cls, tmp_path, ga=K, batch=B, cpo_alpha=0.0)
    with pytest.raises(CompositionError) as error:
        trainer.train()
    message = str(error.value)
    assert "CPOTrainer" in message and "RuntimeError: zero-dimensional tensor" in message
    assert "Stopped before the first optimizer step" in message and trainer.state.global_step == 0
