"""Losses users write in a `compute_loss` override, each run with `GradAccumTrainer` at 4 x 3 against the stock
`Trainer` on the one batch of 12 (CPU fp32, one SGD step): exact at 1e-5, or stopped before the first step with the
cause. Counts that are the same within a micro-batch and differ between micro-batches, weights that appear only in the
third micro-batch, class weights, a loss that divides by `num_items_in_batch`, one that reads the Trainer's state, and
one built from a gradient."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import BertForSequenceClassification, Trainer

from hf_gradaccum import GradAccumTrainer
from hf_gradaccum.losses.model_losses import ModelLossError
from tests.model_loss_cases import _bert, flat, one_step

RTOL = 1e-5


def _classifier(labels: int = 3) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(_bert(num_labels=labels, attn_implementation="eager"))


def _rows(weights: list[float] | None = None, labels: list[int] | None = None, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(12):
        row = {
            "input_ids": torch.randint(1, 64, (8,), generator=g),
            "attention_mask": torch.ones(8, dtype=torch.long),
            "labels": torch.tensor(labels[i] if labels else int(torch.randint(0, 3, (1,), generator=g))),
        }
        if weights is not None:
            row["sample_weight"] = torch.tensor(float(weights[i]))
        rows.append(row)
    return rows


class SampleWeighted:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        w = inputs.pop("sample_weight")
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        per_row = F.cross_entropy(outputs.logits, inputs["labels"], reduction="none")
        loss = (w * per_row).sum() / w.sum()
        return (loss, outputs) if return_outputs else loss


class ClassWeighted:
    weight = torch.tensor([1.0, 4.0, 0.5])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = F.cross_entropy(outputs.logits, inputs["labels"], weight=self.weight)
        return (loss, outputs) if return_outputs else loss


class DividesByItems:
    """transformers' documented pattern, without the `None` guard."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = F.cross_entropy(outputs.logits, inputs["labels"], reduction="sum") / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


class DividesByItemsGuarded:
    """transformers' documented pattern: the `num_items_in_batch` division, else the micro-batch's own mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        summed = F.cross_entropy(outputs.logits, inputs["labels"], reduction="sum")
        loss = summed / num_items_in_batch if num_items_in_batch is not None else summed / len(inputs["labels"])
        return (loss, outputs) if return_outputs else loss


class ReadsTrainerState:
    seen: list = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        steps = self.current_gradient_accumulation_steps  # raises if the probe ran before the window state
        ReadsTrainerState.seen.append((steps, self.state.global_step))
        factor = 1.0 + 0.1 * self.state.global_step  # a curriculum factor: 1.0 on the first step
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = factor * F.cross_entropy(outputs.logits, inputs["labels"])
        return (loss, outputs) if return_outputs else loss


class GradientPenalty:
    """A per-row penalty on the gradient of the loss with respect to the input embeddings (`create_graph=True`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        outputs = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])
        per_row = F.cross_entropy(outputs.logits, inputs["labels"], reduction="none")
        (grad,) = torch.autograd.grad(per_row.sum(), embeds, create_graph=True)
        loss = (per_row + 0.1 * grad.pow(2).sum(dim=(1, 2))).mean()
        return (loss, outputs) if return_outputs else loss


class InBatchPenalty:
    """A statistic of the whole batch (the variance of the logits over its rows): no weighting makes it exact."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = F.cross_entropy(outputs.logits, inputs["labels"]) + outputs.logits.var(dim=0).sum()
        return (loss, outputs) if return_outputs else loss


def _step(mixin, rows, tmp_path, name, *, ours, micro, steps, labels=3, **options):
    base = GradAccumTrainer if ours else Trainer
    cls = type(f"{mixin.__name__}Trainer", (mixin, base), {})
    model = _classifier(labels)
    before = flat(model)
    import tests.model_loss_cases as cases

    saved = cases.GradAccumTrainer, cases.Trainer
    cases.GradAccumTrainer = cases.Trainer = cls  # one_step picks the class by `ours`
    try:
        one_step(model, rows, str(tmp_path / name), ours=ours, micro=micro, steps=steps, **options)
    finally:
        cases.GradAccumTrainer, cases.Trainer = saved
    return flat(model) - before


def _error(ours, reference):
    return float((ours - reference).norm() / reference.norm())


def _parity(mixin, rows, tmp_path, **options):
    reference = _step(mixin, rows, tmp_path, "ref", ours=False, micro=12, steps=1)
    ours = _step(mixin, rows, tmp_path, "ours", ours=True, micro=3, steps=4, **options)
    return _error(ours, reference)


def _finding(tmp_path) -> dict:
    with open(os.path.join(tmp_path / "ours", "accumulation_check.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- exact
def test_sample_weights_only_in_the_third_micro_batch_are_exact(tmp_path):
    weights = [1.0] * 6 + [3.0, 1.0, 5.0] + [1.0] * 3
    assert _parity(SampleWeighted, _rows(weights), tmp_path) <= RTOL
    assert _finding(tmp_path)["loss_normalisation"]["rule"] == "sum:sample_weight"


def test_one_sample_weight_per_micro_batch_is_exact(tmp_path):
    weights = [w for w in (1.0, 2.0, 3.0, 4.0) for _ in range(3)]
    assert _parity(SampleWeighted, _rows(weights), tmp_path) <= RTOL


def test_class_weighted_cross_entropy_is_exact(tmp_path):
    assert _parity(ClassWeighted, _rows(), tmp_path) <= RTOL
    rule = _finding(tmp_path)["loss_normalisation"]["rule"]
    assert rule.startswith("class_weighted:labels=")
    weights = [float(w) for w in rule.split("=")[1].split(",")]
    assert weights == pytest.approx([0.25, 1.0, 0.125], rel=1e-4)


def test_dividing_by_num_items_in_batch_without_the_guard_is_exact(tmp_path):
    assert _parity(DividesByItems, _rows(), tmp_path) <= RTOL
    assert _finding(tmp_path)["loss_normalisation"]["rule"] == "sum"


def test_dividing_by_num_items_in_batch_with_the_guard_is_exact(tmp_path):
    assert _parity(DividesByItemsGuarded, _rows(), tmp_path) <= RTOL


def test_a_subclass_reading_trainer_state_is_exact(tmp_path):
    ReadsTrainerState.seen = []
    assert _parity(ReadsTrainerState, _rows(), tmp_path) <= RTOL
    # The probe saw what training shows: the window's micro-batches, before the first step.
    assert {s for s in ReadsTrainerState.seen[1:]} == {(4, 0)}


def test_a_gradient_penalty_with_create_graph_is_exact(tmp_path):
    assert _parity(GradientPenalty, _rows(), tmp_path) <= RTOL


def test_a_user_count_is_checked_and_exact(tmp_path):
    class Counted(SampleWeighted):
        def count_micro_batch_items(self, inputs):
            return inputs["sample_weight"].sum()

    weights = [w for w in (1.0, 2.0, 3.0, 4.0) for _ in range(3)]
    assert _parity(Counted, _rows(weights), tmp_path) <= RTOL
    assert _finding(tmp_path)["loss_normalisation"]["decided_by"] == "declared"


# ---------------------------------------------------------------- stopped, with the cause
def test_a_user_count_the_window_contradicts_stops(tmp_path):
    class Miscounted(SampleWeighted):
        def count_micro_batch_items(self, inputs):
            return len(inputs["labels"])  # rows, while the loss divides by the weights

    weights = [w for w in (1.0, 2.0, 3.0, 4.0) for _ in range(3)]
    with pytest.raises(
        ModelLossError,
        match=r"SampleWeighted.compute_loss: `MiscountedTrainer.count_micro_batch_items` is contradicted",
    ):
        _step(Miscounted, _rows(weights), tmp_path, "ours", ours=True, micro=3, steps=4)
    assert "stopped" in _finding(tmp_path)


def test_a_statistic_of_the_batch_stops_naming_the_users_class(tmp_path):
    with pytest.raises(ModelLossError) as raised:
        _step(InBatchPenalty, _rows(), tmp_path, "ours", ours=True, micro=3, steps=4)
    message = str(raised.value)
    assert message.startswith("InBatchPenalty.compute_loss: its loss is not a mean over any count")
    assert "count_micro_batch_items" in message and "rows of its batch may refer" not in message
    assert _finding(tmp_path)["stopped"]


def test_an_error_of_the_users_loss_is_reported_as_itself(tmp_path):
    class Broken:
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise KeyError("sample_weight")

    with pytest.raises(KeyError, match="sample_weight") as raised:
        _step(Broken, _rows(), tmp_path, "ours", ours=True, micro=3, steps=4)
    assert any("measuring what the loss divides by" in note for note in raised.value.__notes__)


def test_weights_that_appear_in_a_later_window_stop_before_its_step(tmp_path):
    from hf_gradaccum import GradAccumArguments
    from tests.model_loss_cases import Rows, collate

    rows = _rows([1.0] * 12) + _rows([w for w in (1.0, 2.0, 3.0, 4.0) for _ in range(3)], seed=2)
    cls = type("SampleWeightedTrainer", (SampleWeighted, GradAccumTrainer), {})
    args = GradAccumArguments(
        str(tmp_path / "ours"), per_device_train_batch_size=3, gradient_accumulation_steps=4, max_steps=2,
        optim="sgd", learning_rate=0.1, max_grad_norm=0.0, train_sampling_strategy="sequential",
        remove_unused_columns=False, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = cls(model=_classifier(), args=args, train_dataset=Rows(rows), data_collator=collate)
    with pytest.raises(ModelLossError, match=r"window 2 \(before optimizer step 2\).*contradicts label_tokens"):
        trainer.train()
    assert trainer.state.global_step == 1  # the first step trained (every weight 1: the rules tied), not the second
    finding = _finding(tmp_path)["loss_normalisation"]
    assert finding["decided_by"] == "stopped" and "sum:sample_weight" in finding["stop"]


# ---------------------------------------------------------------- two heads, each a mean over its own count
def _token_rows() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(12):
        labels = torch.randint(0, 3, (8,), generator=g)
        labels[2 + (i // 3) + (i % 2) :] = -100  # label tokens differ between micro-batches and inside them
        rows.append({"input_ids": torch.randint(1, 64, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
                     "labels": labels, "row_labels": torch.tensor(int(torch.randint(0, 3, (1,), generator=g)))})  # fmt: skip
    return rows


class TwoHeads:
    def _terms(self, model, inputs):
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        token_loss = F.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten())  # mean over label tokens
        row_loss = F.cross_entropy(logits[:, 0], inputs["row_labels"])  # mean over rows
        return token_loss, row_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        token_loss, row_loss = self._terms(model, inputs)
        return token_loss + row_loss


class DeclaredTwoHeads(TwoHeads):
    def count_micro_batch_items(self, inputs):
        return {"tokens": inputs["labels"].ne(-100).sum(), "rows": len(inputs["labels"])}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from hf_gradaccum import mean_terms

        token_loss, row_loss = self._terms(model, inputs)
        return mean_terms(self, inputs, tokens=token_loss, rows=row_loss)


def _token_step(mixin, tmp_path, name, *, ours, micro, steps):
    from transformers import BertForTokenClassification

    import tests.model_loss_cases as cases

    base = GradAccumTrainer if ours else Trainer
    cls = type(f"{mixin.__name__}Trainer", (mixin, base), {})
    torch.manual_seed(0)
    model = BertForTokenClassification(_bert(num_labels=3))
    before = flat(model)
    saved = cases.GradAccumTrainer, cases.Trainer
    cases.GradAccumTrainer = cases.Trainer = cls
    try:
        one_step(model, _token_rows(), str(tmp_path / name), ours=ours, micro=micro, steps=steps)
    finally:
        cases.GradAccumTrainer, cases.Trainer = saved
    return flat(model) - before


def test_two_heads_with_different_counts_stop_pointing_to_mean_terms(tmp_path):
    with pytest.raises(ModelLossError, match=r"(?s)TwoHeads.compute_loss: .*mean_terms"):
        _token_step(TwoHeads, tmp_path, "ours", ours=True, micro=3, steps=4)


def test_two_heads_declared_as_terms_are_exact(tmp_path):
    reference = _token_step(DeclaredTwoHeads, tmp_path, "ref", ours=False, micro=12, steps=1)
    ours = _token_step(DeclaredTwoHeads, tmp_path, "ours", ours=True, micro=3, steps=4)
    assert _error(ours, reference) <= RTOL
    finding = _finding(tmp_path)["loss_normalisation"]
    assert finding["rule"] == "terms" and finding["decided_by"] == "declared"
