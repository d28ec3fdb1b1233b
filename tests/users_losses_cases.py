"""The users' losses zoo: `compute_loss` overrides that people write in a `Trainer` subclass, each trained for one
optimizer step on the same window of `ROWS` rows three ways, each from the same initial weights (CPU fp32, SGD,
constant learning rate, no clipping, no weight decay, dataset order, every dropout 0):

- `reference`: the stock `transformers.Trainer` on the window as one batch (`ROWS` x 1);
- `stock`: the stock `Trainer` at `MICRO` x `STEPS` (what plain accumulation gives);
- `ours`: `GradAccumTrainer` with `GradAccumArguments` and default accumulation options, at `MICRO` x `STEPS`.

Each case is one mixin class overriding `compute_loss`, written as a user would write it (`class T(Mixin, Trainer)`,
`class T(Mixin, GradAccumTrainer)`), with its own rows (and, where it needs one, a model head or a frozen teacher).
The data is chosen to expose misweighting: counts and weights that are the same within a micro-batch but differ
between micro-batches (then each micro-batch's own normalisation looks right, and only the window shows the
difference), and weights that appear in the third micro-batch only.

`benchmarks/users_losses_zoo.py` runs every (case, trainer) in its own process, classifies each run against the
reference and writes the table. `train_once` here is the single run; `classify` the verdict.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import Dataset

from tests.ordering import HAS_SAMPLING_STRATEGY, SEQUENTIAL_ORDER, sequential_train_sampler

RTOL = 1e-5
ROWS, MICRO, STEPS = 12, 3, 4
LEARNING_RATE = 0.1
VOCAB, HIDDEN, SEQ, NUM_LABELS = 64, 32, 10, 3
PAD_ID, FIRST_TOKEN = 0, 5
DATA_SEED, MODEL_SEED, TEACHER_SEED = 1, 0, 7

RUNS = {"reference": (ROWS, 1), "stock": (MICRO, STEPS), "ours": (MICRO, STEPS)}
VERDICTS = ("exact", "stopped", "silent", "crashed")

# What the collator pads each variable-length column with (along its first dimension); other columns are stacked.
PAD_VALUES = {"input_ids": PAD_ID, "attention_mask": 0, "labels": -100, "token_weight": 0.0,
              "input_ids_b": PAD_ID, "attention_mask_b": 0}  # fmt: skip

TRAIN_ARGS: dict[str, Any] = dict(
    max_steps=1, optim="sgd", learning_rate=LEARNING_RATE, max_grad_norm=0.0, lr_scheduler_type="constant",
    weight_decay=0.0, warmup_steps=0, seed=0, data_seed=0, remove_unused_columns=False, report_to="none",
    save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_drop_last=False,
    **SEQUENTIAL_ORDER,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Data


class Rows(Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def pad_collator(width: int | None) -> Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    """A collator padding the (1-D) columns of `PAD_VALUES` to `width` (fixed-length padding) or, with `None`, to the
    longest row of the batch (so a micro-batch's width differs from the window's); other columns are stacked."""

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        out = {}
        for key in rows[0]:
            values = [r[key] for r in rows]
            if key in PAD_VALUES and values[0].dim() > 0:
                w = width or max(len(v) for v in values)
                out[key] = torch.stack([F.pad(v, (0, w - len(v)), value=PAD_VALUES[key]) for v in values])
            else:
                out[key] = torch.stack(values)
        return out

    return collate


def per_micro(values: list[Any]) -> list[Any]:
    """One value per micro-batch, repeated for each of its `MICRO` rows."""
    assert len(values) == STEPS
    return [v for v in values for _ in range(MICRO)]


def _lengths(g: torch.Generator, lo: int = 3, hi: int = SEQ) -> list[int]:
    return [int(torch.randint(lo, hi + 1, (1,), generator=g)) for _ in range(ROWS)]


def _ids(g: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(FIRST_TOKEN, VOCAB, (length,), generator=g)


def seq_rows(g: torch.Generator, lengths: list[int] | None = None, labels: list[int] | None = None) -> list[dict]:
    """Sequence classification rows: tokens of the given lengths (random by default), a class each."""
    lengths = lengths or _lengths(g)
    rows = []
    for i, length in enumerate(lengths):
        label = labels[i] if labels is not None else int(torch.randint(0, NUM_LABELS, (1,), generator=g))
        rows.append({"input_ids": _ids(g, length), "attention_mask": torch.ones(length, dtype=torch.long),
                     "labels": torch.tensor(label)})  # fmt: skip
    return rows


def token_rows(g: torch.Generator, lengths: list[int], num_labels: int = NUM_LABELS) -> list[dict]:
    """Token classification rows: a class per token (padding becomes -100 in the collator)."""
    return [
        {"input_ids": _ids(g, n), "attention_mask": torch.ones(n, dtype=torch.long),
         "labels": torch.randint(0, num_labels, (n,), generator=g)}
        for n in lengths
    ]  # fmt: skip


def lm_rows(g: torch.Generator, lengths: list[int]) -> list[dict]:
    """Causal LM rows: the labels are the tokens (padding becomes -100 in the collator)."""
    rows = []
    for n in lengths:
        ids = _ids(g, n)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.long), "labels": ids.clone()})
    return rows


# Token counts the same within a micro-batch and different between micro-batches.
MICRO_LENGTHS = per_micro([3, 10, 5, 8])


# ---------------------------------------------------------------------------------------------------------------------
# The users' compute_loss overrides. Each records how often it ran (`self.case_notes`), nothing else is shared.


def _seen(trainer: Any, inputs: dict[str, Any], **notes: Any) -> None:
    """Record one call of the user's loss (and any notes) on the trainer, for the report."""
    record = trainer.__dict__.setdefault("case_notes", {"calls": 0, "rows": []})
    record["calls"] += 1
    record["rows"].append(int(inputs["input_ids"].shape[0]))
    for key, value in notes.items():
        record.setdefault(key, []).append(value)


def _outputs(loss: torch.Tensor, outputs: Any, return_outputs: bool):
    return (loss, outputs) if return_outputs else loss


def _token_ce(logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), **kwargs)


class MeanCERows:
    """The transformers docs' custom loss: `labels = inputs.pop("labels")`, `nn.CrossEntropyLoss()` on the logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.get("logits")
        loss = torch.nn.CrossEntropyLoss()(logits.view(-1, self.model.config.num_labels), labels.view(-1))
        return _outputs(loss, outputs, return_outputs)


class SampleWeighted:
    """A `sample_weight` column: `(w * per_row_loss).sum() / w.sum()`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        weights = inputs["sample_weight"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        per_row = F.cross_entropy(outputs.logits, inputs["labels"], reduction="none")
        loss = (weights * per_row).sum() / weights.sum()
        return _outputs(loss, outputs, return_outputs)


CLASS_WEIGHTS = [1.0, 3.0, 0.5]


class ClassWeightedSeq:
    """`nn.CrossEntropyLoss(weight=w)` over rows (the docs' imbalanced-classes example): divides by the target weights."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        weight = torch.tensor(CLASS_WEIGHTS, device=outputs.logits.device)
        loss = torch.nn.CrossEntropyLoss(weight=weight)(outputs.logits, labels)
        return _outputs(loss, outputs, return_outputs)


class ClassWeightedTokens:
    """Class-weighted token CE (`ignore_index=-100`): divides by the weights of the label tokens' classes."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        weight = torch.tensor(CLASS_WEIGHTS, device=outputs.logits.device)
        loss = _token_ce(outputs.logits, labels, weight=weight, ignore_index=-100)
        return _outputs(loss, outputs, return_outputs)


class TokenCEMean:
    """Plain `nn.CrossEntropyLoss()` over tokens (mean over label tokens of the batch)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = torch.nn.CrossEntropyLoss()(outputs.logits.view(-1, outputs.logits.shape[-1]), labels.view(-1))
        return _outputs(loss, outputs, return_outputs)


class NumItemsUnguarded:
    """Token CE summed, divided by `num_items_in_batch` (transformers' documented pattern, without the None guard)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs, num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch))
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _token_ce(outputs.logits, labels, ignore_index=-100, reduction="sum") / num_items_in_batch
        return _outputs(loss, outputs, return_outputs)


class NumItemsGuarded:
    """The same with `if num_items_in_batch is not None` (else the mean over label tokens)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs, num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch))
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        if num_items_in_batch is not None:
            loss = _token_ce(outputs.logits, labels, ignore_index=-100, reduction="sum") / num_items_in_batch
        else:
            loss = _token_ce(outputs.logits, labels, ignore_index=-100)
        return _outputs(loss, outputs, return_outputs)


class ReadsTrainerState:
    """Reads `current_gradient_accumulation_steps` and `state.global_step` (records them; a curriculum factor that is
    1.0 at step 0) without scaling by the accumulation steps; mean CE over rows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs, ga_steps=self.current_gradient_accumulation_steps, global_step=self.state.global_step)
        factor = 1.0 / (1.0 + 0.5 * self.state.global_step)
        outputs = model(**inputs)
        loss = factor * outputs.loss
        return _outputs(loss, outputs, return_outputs)


class GradientPenalty:
    """CE per row plus the squared norm of d loss_row / d inputs_embeds (double backward: `create_graph=True`),
    mean over rows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        outputs = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])
        per_row = F.cross_entropy(outputs.logits, inputs["labels"], reduction="none")
        (grad,) = torch.autograd.grad(per_row.sum(), embeds, create_graph=True)
        penalty = grad.pow(2).sum(dim=(1, 2))
        loss = (per_row + 10.0 * penalty).mean()
        return _outputs(loss, outputs, return_outputs)


class TwoHeads:
    """Token CE mean over label tokens + a sequence head's CE mean over rows, undeclared (two terms, two counts)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        output_hidden_states=True)  # fmt: skip
        token_loss = _token_ce(outputs.logits, inputs["labels"], ignore_index=-100)
        row_logits = model.seq_head(outputs.hidden_states[-1][:, 0])
        row_loss = F.cross_entropy(row_logits, inputs["row_labels"])
        return _outputs(token_loss + row_loss, outputs, return_outputs)


class TwoHeadsDeclared(TwoHeads):
    """The same two terms, declared: each term's count from `count_micro_batch_items`, combined by `mean_terms` (the
    plain sum under the stock Trainer)."""

    def count_micro_batch_items(self, inputs):
        return {"tokens": inputs["labels"].ne(-100).sum(), "rows": len(inputs["row_labels"])}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from hf_gradaccum import mean_terms

        _seen(self, inputs)
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        output_hidden_states=True)  # fmt: skip
        token_loss = _token_ce(outputs.logits, inputs["labels"], ignore_index=-100)
        row_loss = F.cross_entropy(model.seq_head(outputs.hidden_states[-1][:, 0]), inputs["row_labels"])
        return _outputs(mean_terms(self, inputs, tokens=token_loss, rows=row_loss), outputs, return_outputs)


class LabelSmoothingManual:
    """Label smoothing by hand (0.1), per token, then the mean over label tokens."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logp = outputs.logits.log_softmax(-1)
        keep = labels != -100
        nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        smooth = -logp.mean(-1)
        per_token = 0.9 * nll + 0.1 * smooth
        loss = per_token[keep].mean()
        return _outputs(loss, outputs, return_outputs)


class FocalRows:
    """Focal loss (gamma 2), mean over rows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logp = outputs.logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss = (-((1 - logp.exp()) ** 2) * logp).mean()
        return _outputs(loss, outputs, return_outputs)


class SumRows:
    """CE with `reduction="sum"` over rows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits, labels, reduction="sum")
        return _outputs(loss, outputs, return_outputs)


class DistillKL:
    """Distillation: KL to a frozen teacher (`self.teacher`, another tiny BERT), `batchmean`, T=2, plus CE."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits
        t = 2.0
        kl = F.kl_div((outputs.logits / t).log_softmax(-1), (teacher_logits / t).softmax(-1), reduction="batchmean")
        loss = 0.5 * kl * t * t + 0.5 * F.cross_entropy(outputs.logits, labels)
        return _outputs(loss, outputs, return_outputs)


class MaskedMeanAttended:
    """Per-token CE (labels on every position, padding included) * attention_mask, summed / attention_mask.sum()."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        mask = inputs["attention_mask"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=mask)
        per_token = _token_ce(outputs.logits, inputs["labels"], reduction="none").view(mask.shape)
        loss = (per_token * mask).sum() / mask.sum()
        return _outputs(loss, outputs, return_outputs)


class InBatchContrastive:
    """InfoNCE over the micro-batch: row i's two views are the positive pair, the other rows' views the negatives."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        out_a = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        out_b = model(input_ids=inputs["input_ids_b"], attention_mask=inputs["attention_mask_b"])
        za, zb = F.normalize(out_a.logits, dim=-1), F.normalize(out_b.logits, dim=-1)
        scores = za @ zb.T / 0.1
        loss = F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))
        return _outputs(loss, out_a, return_outputs)


class RDrop:
    """R-drop: two forwards (the second with a fixed per-row perturbation of the embeddings, standing in for dropout so
    that every run sees the same function), CE of both + symmetric KL, mean over rows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        out1 = model(input_ids=ids, attention_mask=mask)
        embeds = model.get_input_embeddings()(ids) + 0.5 * inputs["noise"][:, : ids.shape[1]]
        out2 = model(inputs_embeds=embeds, attention_mask=mask)
        lp1, lp2 = out1.logits.log_softmax(-1), out2.logits.log_softmax(-1)
        ce = 0.5 * (F.nll_loss(lp1, labels) + F.nll_loss(lp2, labels))
        kl = 0.5 * (F.kl_div(lp1, lp2, reduction="batchmean", log_target=True)
                    + F.kl_div(lp2, lp1, reduction="batchmean", log_target=True))  # fmt: skip
        loss = ce + 1.0 * kl
        return _outputs(loss, out1, return_outputs)


class CausalLMByHand:
    """A causal LM loss by hand: shift, CE over the non -100 tokens, mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits = outputs.logits[:, :-1]
        labels = inputs["labels"][:, 1:]
        loss = _token_ce(logits, labels, ignore_index=-100)
        return _outputs(loss, outputs, return_outputs)


class FloatMaskTokens:
    """A float mask column weighting tokens: `(loss_tok * m).sum() / m.sum()`, m in [0, 1]."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        m = inputs["token_weight"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        per_token = _token_ce(outputs.logits, inputs["labels"], reduction="none", ignore_index=-100).view(m.shape)
        loss = (per_token * m).sum() / m.sum()
        return _outputs(loss, outputs, return_outputs)


class ModelLossPlusL2:
    """The model's own loss (mean over rows) plus an L2 penalty on the classifier weights (a term of no row)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _seen(self, inputs)
        outputs = model(**inputs)
        l2 = sum(p.pow(2).sum() for p in model.classifier.parameters())
        loss = outputs.loss + 0.05 * l2
        return _outputs(loss, outputs, return_outputs)


# ---------------------------------------------------------------------------------------------------------------------
# Rows of each case


def _sample_weight(weights: list[float]) -> Callable[[torch.Generator], list[dict]]:
    def rows(g: torch.Generator) -> list[dict]:
        out = seq_rows(g)
        for row, w in zip(out, weights, strict=True):
            row["sample_weight"] = torch.tensor(float(w))
        return out

    return rows


def _class_weighted_seq_rows(g: torch.Generator) -> list[dict]:
    # micro-batch i all of class i (the last mixed): each micro-batch's weighted mean is its plain mean.
    return seq_rows(g, labels=[0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 1, 2])


def _class_weighted_token_rows(g: torch.Generator) -> list[dict]:
    rows = token_rows(g, MICRO_LENGTHS)
    for i, row in enumerate(rows):  # one dominant class per micro-batch
        row["labels"] = torch.full_like(row["labels"], min(i // MICRO, NUM_LABELS - 1))
        row["labels"][::3] = torch.randint(0, NUM_LABELS, row["labels"][::3].shape, generator=g)
    return rows


def _two_heads_rows(g: torch.Generator) -> list[dict]:
    rows = token_rows(g, MICRO_LENGTHS)
    for row in rows:
        row["row_labels"] = torch.randint(0, NUM_LABELS, (), generator=g)
    return rows


def _attended_rows(g: torch.Generator) -> list[dict]:
    # fixed-length padding (SEQ) whose amount differs between micro-batches; labels on every position
    rows = token_rows(g, per_micro([2, 10, 4, 7]))
    for row in rows:
        row["labels"] = torch.randint(0, NUM_LABELS, (SEQ,), generator=g)
    return rows


def _contrastive_rows(g: torch.Generator) -> list[dict]:
    rows = []
    for n in _lengths(g, 4):
        ids = _ids(g, n)
        other = ids.clone()
        where = torch.randint(0, n, (2,), generator=g)
        other[where] = _ids(g, 2)
        mask = torch.ones(n, dtype=torch.long)
        rows.append({"input_ids": ids, "attention_mask": mask, "input_ids_b": other, "attention_mask_b": mask.clone()})
    return rows


def noise_rows(g: torch.Generator) -> list[dict]:
    """Sequence rows with a fixed per-row embedding perturbation (R-drop's second view without dropout)."""
    rows = seq_rows(g)
    for row in rows:
        row["noise"] = torch.randn(SEQ, HIDDEN, generator=g)
    return rows


def _float_mask_rows(g: torch.Generator) -> list[dict]:
    rows = token_rows(g, MICRO_LENGTHS)
    for row, c in zip(rows, per_micro([0.2, 1.0, 0.5, 0.9]), strict=True):
        row["token_weight"] = torch.full((len(row["input_ids"]),), c)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Models


def bert_config(num_labels: int = NUM_LABELS) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, classifier_dropout=0.0, num_labels=num_labels,
                      attn_implementation="eager")  # fmt: skip


def bert_seq(num_labels: int = NUM_LABELS) -> torch.nn.Module:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(bert_config(num_labels))


def bert_tok() -> torch.nn.Module:
    from transformers import BertForTokenClassification

    return BertForTokenClassification(bert_config())


def bert_tok_two_heads() -> torch.nn.Module:
    model = bert_tok()
    model.seq_head = torch.nn.Linear(HIDDEN, NUM_LABELS)
    return model


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32, pad_token_id=PAD_ID, attention_dropout=0.0))  # fmt: skip


def _with_teacher(trainer: Any) -> None:
    torch.manual_seed(TEACHER_SEED)
    teacher = bert_seq().eval()
    teacher.requires_grad_(False)
    trainer.teacher = teacher


# ---------------------------------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class Case:
    """One user's loss.

    Args:
        name: short, descriptive.
        mixin: the class overriding `compute_loss`.
        model: builds the tiny random-init model (seeded by the caller).
        rows: builds the window's rows from a seeded generator.
        divides_by: the loss's own normalisation in words.
        width: fixed padding width, or `None` to pad each batch to its longest row.
        prepare: called with the trainer after construction (a frozen teacher).
        args: `TrainingArguments` fields changed from `TRAIN_ARGS`.

    `train_once` reads only `mixin`, `model`, `rows`, `width`, `prepare` and `args`: another zoo's case class with those
    fields (`tests/subclass_cases.py`) runs through it as well.
    """

    name: str
    mixin: type
    model: Callable[[], torch.nn.Module]
    rows: Callable[[torch.Generator], list[dict]]
    divides_by: str
    width: int | None = None
    prepare: Callable[[Any], None] | None = None
    args: dict[str, Any] = field(default_factory=dict)


CASES: tuple[Case, ...] = (
    Case("mean_ce_rows", MeanCERows, bert_seq, seq_rows, "rows (the docs' `inputs.pop('labels')` example)"),
    Case("sample_weight_third", SampleWeighted, bert_seq, _sample_weight([1] * 6 + [5] * 3 + [1] * 3),
         "sum of `sample_weight` (5 in the third micro-batch only, else 1)"),
    Case("sample_weight_per_micro", SampleWeighted, bert_seq, _sample_weight(per_micro([1, 2, 3, 4])),
         "sum of `sample_weight` (micro-batch i: all i+1)"),
    Case("class_weighted_seq", ClassWeightedSeq, bert_seq, _class_weighted_seq_rows,
         "sum of the targets' class weights (one class per micro-batch)"),
    Case("class_weighted_tokens", ClassWeightedTokens, bert_tok, _class_weighted_token_rows,
         "sum of the label tokens' class weights; lengths 3/10/5/8 per micro-batch"),
    Case("token_ce_mean", TokenCEMean, bert_tok, lambda g: token_rows(g, MICRO_LENGTHS),
         "label tokens; lengths 3/10/5/8 per micro-batch"),
    Case("num_items_unguarded", NumItemsUnguarded, bert_tok, lambda g: token_rows(g, MICRO_LENGTHS),
         "`num_items_in_batch` (no None guard)"),
    Case("num_items_guarded", NumItemsGuarded, bert_tok, lambda g: token_rows(g, MICRO_LENGTHS),
         "`num_items_in_batch`, else label tokens"),
    Case("reads_ga_state", ReadsTrainerState, bert_seq, seq_rows,
         "rows, x a curriculum factor of `state.global_step` (1.0 at step 0)"),
    Case("grad_penalty", GradientPenalty, bert_seq, seq_rows,
         "rows (CE + d loss/d embeds norm, `create_graph=True`)"),
    Case("two_heads_undeclared", TwoHeads, bert_tok_two_heads, _two_heads_rows,
         "label tokens + rows (two terms, undeclared)"),
    Case("two_heads_declared", TwoHeadsDeclared, bert_tok_two_heads, _two_heads_rows,
         "label tokens + rows, each term declared with its count (`mean_terms`)"),
    Case("label_smoothing_manual", LabelSmoothingManual, bert_tok, lambda g: token_rows(g, MICRO_LENGTHS),
         "label tokens (smoothing 0.1 by hand)"),
    Case("focal_rows", FocalRows, bert_seq, seq_rows, "rows (focal, gamma 2)"),
    Case("sum_rows", SumRows, bert_seq, seq_rows, "nothing (sum over rows)"),
    Case("distill_kl", DistillKL, bert_seq, seq_rows, "rows (KL batchmean to a frozen teacher + CE)",
         prepare=_with_teacher),
    Case("masked_mean_attended", MaskedMeanAttended, bert_tok, _attended_rows,
         "attended tokens (attention_mask sum; fixed width 10, lengths 2/10/4/7)", width=SEQ),
    Case("in_batch_contrastive", InBatchContrastive, lambda: bert_seq(8), _contrastive_rows,
         "rows, over in-batch negatives (a statistic of the batch)"),
    Case("rdrop", RDrop, bert_seq, noise_rows, "rows (two forwards, CE + symmetric KL)"),
    Case("causal_lm_by_hand", CausalLMByHand, llama, lambda g: lm_rows(g, MICRO_LENGTHS),
         "shifted label tokens; lengths 3/10/5/8 per micro-batch, padded per batch"),
    Case("float_mask_tokens", FloatMaskTokens, bert_tok, _float_mask_rows,
         "sum of a float token mask (0.2/1.0/0.5/0.9 per micro-batch)"),
    Case("model_loss_plus_l2", ModelLossPlusL2, bert_seq, seq_rows,
         "rows, + an L2 penalty of the classifier (a term of no row)"),
)  # fmt: skip


def find_case(name: str, cases: tuple[Any, ...] = CASES) -> Any:
    """The case of `cases` (this module's by default) called `name`."""
    for case in cases:
        if case.name == name:
            return case
    raise KeyError(f"no case {name!r}; the cases: {', '.join(c.name for c in cases)}")


# ---------------------------------------------------------------------------------------------------------------------
# One run


def flat_trainable(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters() if p.requires_grad])


def build(case: Any) -> tuple[torch.nn.Module, list[dict]]:
    """The case's model (seeded, the same initial weights every time) and its window's rows."""
    torch.manual_seed(MODEL_SEED)
    model = case.model()
    return model, case.rows(torch.Generator().manual_seed(DATA_SEED))


def trainer_class(case: Any, kind: str) -> type:
    """`class T(Mixin, Trainer)` (reference, stock) or `class T(Mixin, GradAccumTrainer)` (ours)."""
    from transformers import Trainer

    if kind == "ours":
        from hf_gradaccum import GradAccumTrainer as base
    else:
        base = Trainer
    namespace: dict[str, Any] = {}
    # transformers 4.x: dataset order by the Trainer's own extension point, unless the mixin sets its own sampler
    if not HAS_SAMPLING_STRATEGY and not hasattr(case.mixin, "_get_train_sampler"):
        namespace["_get_train_sampler"] = sequential_train_sampler
    if getattr(case, "parent_order", False) and base is not Trainer:
        # The user's existing subclass of `Trainer`, composed after GradAccumTrainer: `class T(GradAccumTrainer, Base)`.
        existing = type(f"{case.mixin.__name__}Trainer", (case.mixin, Trainer), {})
        return type(f"GradAccumTrainer{existing.__name__}", (base, existing), namespace)
    return type(f"{case.mixin.__name__}{base.__name__}", (case.mixin, base), namespace)


@contextlib.contextmanager
def _count_optimizer_steps():
    counter = {"steps": 0}

    def hook(optimizer, args, kwargs):
        counter["steps"] += 1

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield counter
    finally:
        handle.remove()


CASES_FILE = "tests/users_losses_cases.py"


def _where(error: BaseException, cases_file: str = CASES_FILE) -> str:
    """The innermost frame of the traceback that is the case's own code (in `cases_file`), the package's, or
    transformers'."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        for marker in ("hf_gradaccum/", cases_file, "transformers/", "accelerate/"):
            if marker in path:
                return f"{path[path.index(marker) :]}:{frame.lineno} ({frame.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def train_once(
    case: Any,
    kind: str,
    output_dir: str,
    *,
    cases_file: str = CASES_FILE,
    dataset_type: Callable[[list[dict]], Dataset] = Rows,
    observe: Callable[[dict[str, Any], Any, Dataset], None] | None = None,
) -> dict[str, Any]:
    """One optimizer step of the case with the run `kind` of `RUNS`: the update (or the exception), the optimizer
    steps taken, what the user's loss recorded and, for ours, the package's own finding.

    For another zoo's cases: `cases_file` is where their mixins are (an exception raised there is the user's),
    `dataset_type` wraps the window's rows, and `observe(out, trainer, dataset)` adds that zoo's own fields to the run
    after the steps are counted (`trainer` is `None` where it was not built)."""
    from transformers import TrainingArguments

    micro, steps = RUNS[kind]
    if kind == "ours":
        from hf_gradaccum import GradAccumArguments as args_cls
    else:
        args_cls = TrainingArguments
    model, rows = build(case)
    dataset = dataset_type(rows)
    before = flat_trainable(model)
    out: dict[str, Any] = {"kind": kind}
    trainer = None
    with _count_optimizer_steps() as counter:
        try:
            args = args_cls(output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=steps,
                            **{**TRAIN_ARGS, **case.args})  # fmt: skip
            trainer = trainer_class(case, kind)(model=model, args=args, train_dataset=dataset,
                                                data_collator=pad_collator(case.width))  # fmt: skip
            if case.prepare is not None:
                case.prepare(trainer)
            trainer.train()
            out["update"] = flat_trainable(model) - before
        except Exception as e:  # classified, not raised: the zoo reports every run
            out["exception"] = {
                "type": type(e).__name__,
                "module": type(e).__module__,
                "message": str(e),
                "where": _where(e, cases_file),
                "traceback": traceback.format_exc()[-3000:],
            }
            # Beyond rounding: an override's own perturb-and-restore (SAM's `p.add_(e)`, `p.sub_(e)`) leaves the last
            # bit of some weights changed, which is not a step.
            after = flat_trainable(model)
            out["weight_change"] = float((after - before).norm() / before.norm().clamp_min(1e-30))
            out["moved"] = not out["weight_change"] <= 1e-6
    out["optimizer_steps"] = counter["steps"]
    out["global_step"] = trainer.state.global_step if trainer is not None else 0
    if observe is not None:
        observe(out, trainer, dataset)
    notes = dict(getattr(trainer, "case_notes", {}) or {})
    if "rows" in notes:
        notes["rows"] = notes["rows"][:40]
    out["notes"] = notes
    check = os.path.join(output_dir, "accumulation_check.json")
    if os.path.isfile(check):
        with open(check) as f:
            out["accumulation_check"] = json.load(f)
    return out


def quietly(fn: Callable[[], Any]) -> Any:
    """Call `fn` with warnings and library logging below ERROR silenced (tiny random models warn about themselves)."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    finally:
        logging.disable(disabled)


# ---------------------------------------------------------------------------------------------------------------------
# Verdicts


@dataclass
class Outcome:
    """One run against the reference: `verdict` in `VERDICTS`; `error` the relative update difference where it
    trained; `message` the exception's type and first line; `where` where it was raised."""

    verdict: str
    error: float | None = None
    message: str = ""
    where: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    """`||update - reference|| / ||reference||`."""
    return float((update - reference).norm() / reference.norm())


def first_line(message: str, limit: int = 300) -> str:
    return (message.strip().splitlines() or [""])[0][:limit]


def classify(run: dict[str, Any], update: torch.Tensor | None, reference: torch.Tensor) -> Outcome:
    """`exact` (<= RTOL), `stopped` (an exception before the first optimizer step, the weights unchanged), `crashed`
    (an exception after the weights moved or a step was taken, or no finite update) or `silent` (trained, not exact).

    Example:

    ```python
    >>> import torch
    >>> from tests.users_losses_cases import classify
    >>> classify({}, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])).verdict
    'exact'
    ```
    """
    error = run.get("exception")
    if error is not None:
        message = f"{error['type']}: {first_line(error['message'])}"
        if not run.get("moved") and not run.get("optimizer_steps"):
            return Outcome("stopped", message=message, where=error.get("where", ""))
        return Outcome("crashed", message=message + " (after the weights moved)", where=error.get("where", ""))
    if update is None:
        return Outcome("crashed", message="no update came back")
    value = relative(update, reference)
    if value != value:
        return Outcome("crashed", message="the update is not finite")
    return Outcome("exact" if value <= RTOL else "silent", error=value)
