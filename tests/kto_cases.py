"""Shared pieces of the KTO composition tests (`tests/test_composition_kto.py` and the DDP worker
`tests/workers/kto_ddp.py`): the two class orders, an unpaired dataset with an uneven desirable/undesirable split
(`label = i % 3 != 0`), and one SGD(lr=1) step of a KTO trainer returning the update and TRL's recorded KL
baselines."""

from __future__ import annotations

import random
from dataclasses import dataclass

import datasets
import torch
from transformers import TrainerCallback
from trl import KTOConfig, KTOTrainer

from hf_gradaccum import GradAccumTrainer
from tests.composition_cases import WORDS, flat_trainable, tiny_llama, word_tokenizer

B, K = 4, 3


class GradAccumFirstKTO(GradAccumTrainer, KTOTrainer):
    pass


class KTOFirstGradAccum(KTOTrainer, GradAccumTrainer):
    pass


ORDERS = {"gradaccum_first": GradAccumFirstKTO, "kto_first": KTOFirstGradAccum}


def kto_dataset(rows: int) -> datasets.Dataset:
    """`rows` unpaired (prompt, completion, label) rows; one in three undesirable, so micro-batches split unevenly."""
    rng = random.Random(0)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return datasets.Dataset.from_dict(
        {
            "prompt": [sentence(1, 6) for _ in range(rows)],
            "completion": [sentence(1, 8) for _ in range(rows)],
            "label": [i % 3 != 0 for i in range(rows)],
        }
    )


class _RecordKL(TrainerCallback):
    """Copies TRL's `kl` metric list at each optimizer step (the log at the end of `train()` clears it)."""

    def __init__(self) -> None:
        self.trainer: KTOTrainer | None = None
        self.kls: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.kls = list(self.trainer._metrics["train"].get("kl", []))
        return control


@dataclass
class KTORun:
    trainer: KTOTrainer
    update: torch.Tensor  # trainable parameters after minus before, flat
    kls: list[float]  # TRL's `kl` metric: the baseline each loss computation used


def train_kto(
    cls: type,
    output_dir: str,
    *,
    ga: int,
    batch: int,
    rows: int,
    loss_type: str = "kto",
    **config: object,
) -> KTORun:
    """One SGD(lr=1) step (fp32, sequential sampling, no clipping) of `cls` on the first `rows` rows of
    `kto_dataset`, with `per_device_train_batch_size=batch` and `gradient_accumulation_steps=ga`. The reference model
    is initialised apart from the policy, with sharper next-token distributions (its LM head scaled by 30), so that the
    KL baseline is far from 0 and from TRL's clamp at 0 (with `ref_model = deepcopy(model)` it is exactly 0 at the
    first step, and between two random initialisations it is slightly negative, clamped to 0)."""
    torch.manual_seed(1)
    ref_model = tiny_llama()
    with torch.no_grad():
        ref_model.lm_head.weight.mul_(30.0)
    torch.manual_seed(0)
    model = tiny_llama()
    args = KTOConfig(
        output_dir,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        max_steps=1,
        loss_type=loss_type,
        bf16=False,  # TRL's default; on CPU it autocasts to bf16
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",  # keeps TRL's per-loss `kl` metric list (logging would average and clear it)
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **config,
    )
    record = _RecordKL()
    trainer = cls(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=kto_dataset(rows),
        processing_class=word_tokenizer(),
        callbacks=[record],
    )
    record.trainer = trainer
    initial = flat_trainable(trainer.model)
    trainer.train()
    return KTORun(trainer, flat_trainable(trainer.model) - initial, record.kls)
