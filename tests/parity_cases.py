"""Tiny random-init transformers models and real `datasets.Dataset`s for the parity tests, plus the hand-computed
large-batch reference (one SGD(lr=1) step per window, computed on the window's samples as one batch)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import datasets
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2Config,
    GPT2LMHeadModel,
    ResNetConfig,
    ResNetForImageClassification,
    Trainer,
    ViTConfig,
    ViTForImageClassification,
    default_data_collator,
)

from tests.ordering import SEQUENTIAL_ORDER

SEQ_LEN = 12
VOCAB = 64


def tiny_bert_config(**kwargs) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **kwargs,
    )


def _lengths(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(3, SEQ_LEN + 1, (n,), generator=g)


def _text_rows(n: int, g: torch.Generator) -> dict[str, list]:
    lengths = _lengths(n, g)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
    mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # right padding with id 0
    return {"input_ids": ids, "attention_mask": mask}


def seq_cls_data(n: int, g: torch.Generator) -> datasets.Dataset:
    rows = _text_rows(n, g)
    rows["labels"] = torch.randint(0, 3, (n,), generator=g)
    return _to_dataset(rows)


def regression_data(n: int, g: torch.Generator) -> datasets.Dataset:
    rows = _text_rows(n, g)
    rows["labels"] = torch.randn(n, generator=g)
    return _to_dataset(rows)


def token_cls_data(n: int, g: torch.Generator) -> datasets.Dataset:
    rows = _text_rows(n, g)
    labels = torch.randint(0, 4, (n, SEQ_LEN), generator=g)
    # Pads and a random ~30% of real tokens are ignored: micro-batches hold very different item counts.
    ignored = (rows["attention_mask"] == 0) | (torch.rand(n, SEQ_LEN, generator=g) < 0.3)
    rows["labels"] = labels.masked_fill(ignored, -100)
    return _to_dataset(rows)


def mlm_data(n: int, g: torch.Generator) -> datasets.Dataset:
    rows = _text_rows(n, g)
    masked = (torch.rand(n, SEQ_LEN, generator=g) < 0.25) & (rows["attention_mask"] == 1)
    masked[:, 0] = True  # at least one target per row
    rows["labels"] = rows["input_ids"].masked_fill(~masked, -100)
    rows["input_ids"] = rows["input_ids"].masked_fill(masked, VOCAB - 1)  # [MASK]
    return _to_dataset(rows)


def causal_lm_data(n: int, g: torch.Generator) -> datasets.Dataset:
    rows = _text_rows(n, g)
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    return _to_dataset(rows)


def image_data(n: int, g: torch.Generator) -> datasets.Dataset:
    return _to_dataset(
        {"pixel_values": torch.randn(n, 1, 8, 8, generator=g), "labels": torch.randint(0, 5, (n,), generator=g)}
    )


def _to_dataset(rows: dict[str, torch.Tensor]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({k: v.tolist() for k, v in rows.items()})


def tiny_resnet_groupnorm() -> ResNetForImageClassification:
    """A ResNet head (it ignores `num_items_in_batch`) with BatchNorm converted to GroupNorm, so it can match."""
    from hf_gradaccum import convert_batchnorm_to_groupnorm

    config = ResNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5
    )
    return convert_batchnorm_to_groupnorm(ResNetForImageClassification(config), num_groups=4)


def tiny_vit() -> ViTForImageClassification:
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=5,
    )
    return ViTForImageClassification(config)


class LabelSmoothedLossTrainerMixin:
    """A user's `compute_loss` override: label-smoothed cross-entropy, a plain mean over the batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits, labels, label_smoothing=0.1)
        return (loss, outputs) if return_outputs else loss


def sum_over_items_loss(outputs, labels, num_items_in_batch=None):
    """A `compute_loss_func` in the HF convention: sum of per-item losses divided by `num_items_in_batch`."""
    loss = F.cross_entropy(outputs.logits.flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


@dataclass
class ParityCase:
    name: str
    make_model: Callable[[], torch.nn.Module]
    make_data: Callable[[int, torch.Generator], datasets.Dataset]
    shift_labels: bool = False
    custom_loss: bool = False  # the LabelSmoothedLossTrainerMixin override
    compute_loss_func: Callable | None = None


CASES = [
    ParityCase("bert_seq_cls", lambda: BertForSequenceClassification(tiny_bert_config(num_labels=3)), seq_cls_data),
    ParityCase(
        "bert_regression",
        lambda: BertForSequenceClassification(tiny_bert_config(num_labels=1)),
        regression_data,
    ),
    ParityCase("bert_token_cls", lambda: BertForTokenClassification(tiny_bert_config(num_labels=4)), token_cls_data),
    ParityCase("bert_mlm", lambda: BertForMaskedLM(tiny_bert_config()), mlm_data),
    ParityCase(
        "gpt2_causal_lm",
        lambda: GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=32,
                n_embd=16,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        causal_lm_data,
        shift_labels=True,
    ),
    ParityCase("vit_image_cls", tiny_vit, image_data),
    ParityCase("resnet_groupnorm_image_cls", tiny_resnet_groupnorm, image_data),
    ParityCase(
        "user_compute_loss",
        lambda: BertForSequenceClassification(tiny_bert_config(num_labels=3)),
        seq_cls_data,
        custom_loss=True,
    ),
    ParityCase(
        "user_compute_loss_func",
        lambda: BertForTokenClassification(tiny_bert_config(num_labels=4)),
        token_cls_data,
        compute_loss_func=sum_over_items_loss,
    ),
]

# (number of samples, micro-batch size, accumulation steps): the window layouts that break naive accumulation.
LAYOUTS = {
    "even": (16, 4, 4),  # one window of 4 x 4
    "short_last_micro": (14, 4, 4),  # one window of 4 + 4 + 4 + 2
    "partial_last_window": (22, 4, 4),  # windows [4,4,4,4] and [4,2]: the end of an epoch
}


def reference_windows(n: int, micro: int, steps: int) -> list[list[int]]:
    """Sample indices of each window, in the sequential order the Trainer sees them."""
    idx = list(range(n))
    batches = [idx[i : i + micro] for i in range(0, n, micro)]
    return [sum(batches[i : i + steps], []) for i in range(0, len(batches), steps)]


def large_batch_reference(
    case: ParityCase,
    model: torch.nn.Module,
    data: datasets.Dataset,
    windows: list[list[int]],
    lr: float = 1.0,
    max_grad_norm: float = 0.0,
    norms: list[float] | None = None,
):
    """SGD steps (lr=1 by default), one per window, each on the window's samples as one batch: the update to match.
    With `max_grad_norm` > 0 each large-batch gradient is clipped to it first; `norms` collects their norms."""
    model = copy.deepcopy(model)
    model.train()
    for window in windows:
        batch = default_data_collator([data[i] for i in window])
        if case.custom_loss:
            labels = batch.pop("labels")
            loss = F.cross_entropy(model(**batch).logits, labels, label_smoothing=0.1)
        elif case.compute_loss_func is not None:
            labels = batch.pop("labels")
            loss = case.compute_loss_func(model(**batch), labels, int(labels.ne(-100).sum()))
        else:
            loss = model(**batch).loss
        model.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
        if norms is not None:
            norms.append(float(norm))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    return model


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters()])


def relative_update_error(before: torch.nn.Module, after: torch.nn.Module, reference: torch.nn.Module) -> float:
    w0 = flat_params(before)
    d = flat_params(after) - w0
    d_ref = flat_params(reference) - w0
    return float((d - d_ref).norm() / d_ref.norm())


def train_with(
    trainer_cls: type[Trainer],
    case: ParityCase,
    model,
    data,
    micro: int,
    steps: int,
    output_dir: str,
    args_cls=None,
    use_cpu: bool = True,
    max_grad_norm: float = 0.0,
    **options,
):
    """Train one epoch with `trainer_cls` (SGD lr=1, sequential order, no clipping unless `max_grad_norm`; `options`
    are further arguments); return the trained model."""
    from hf_gradaccum import GradAccumArguments

    args_cls = args_cls or GradAccumArguments
    if case.custom_loss:
        trainer_cls = type(f"User{trainer_cls.__name__}", (LabelSmoothedLossTrainerMixin, trainer_cls), {})
    args = args_cls(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=max_grad_norm,
        weight_decay=0.0,
        num_train_epochs=1,
        **SEQUENTIAL_ORDER,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=use_cpu,
        disable_tqdm=True,
        dataloader_drop_last=False,
        seed=0,
        **options,
    )
    model = copy.deepcopy(model)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, compute_loss_func=case.compute_loss_func)
    trainer.train()
    return trainer.model, trainer
