"""GradAccumTrainer composed with TRL's KTOTrainer, in either class order. KTO's `loss_type='kto'` estimates its KL
baseline from the mismatched pairs of each batch of `per_device_train_batch_size` (TRL rotates completions within
it), so under accumulation it is a statistic of the micro-batch: refused before training, naming the trainer, the loss
type and the fix. `apo_zero_unpaired` (no KL term) is a mean over completions and equals the large batch: one SGD(lr=1)
step at b = 4, K = 3 against the stock KTOTrainer at GA = 1 with b x K, fp32, tolerance 1e-5 relative."""

from __future__ import annotations

import copy
import random

import datasets
import pytest
import torch

pytest.importorskip("trl")

from trl import KTOConfig, KTOTrainer  # noqa: E402

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from tests.composition_cases import WORDS, flat_trainable, tiny_llama, word_tokenizer  # noqa: E402

RTOL = 1e-5
B, K = 4, 3


class GradAccumFirstKTO(GradAccumTrainer, KTOTrainer):
    pass


class KTOFirstGradAccum(KTOTrainer, GradAccumTrainer):
    pass


ORDERS = {"gradaccum_first": GradAccumFirstKTO, "kto_first": KTOFirstGradAccum}


def _dataset() -> datasets.Dataset:
    rng = random.Random(0)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return datasets.Dataset.from_dict(
        {
            "prompt": [sentence(1, 6) for _ in range(B * K)],
            "completion": [sentence(1, 8) for _ in range(B * K)],
            "label": [i % 3 != 0 for i in range(B * K)],
        }
    )


def _train(cls, output_dir: str, *, ga: int, batch: int, loss_type: str) -> torch.Tensor:
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
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = cls(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=_dataset(),
        processing_class=word_tokenizer(),
    )
    initial = flat_trainable(trainer.model)
    trainer.train()
    return flat_trainable(trainer.model) - initial


def test_kto_loss_with_kl_baseline_is_refused_before_training(tmp_path):
    for order, cls in ORDERS.items():
        with pytest.raises(ValueError) as error:
            _train(cls, str(tmp_path / order), ga=K, batch=B, loss_type="kto")
        message = str(error.value)
        assert "KTOTrainer" in message and "'kto'" in message and "apo_zero_unpaired" in message


def test_kto_without_kl_term_equals_the_large_batch(tmp_path):
    reference = _train(KTOTrainer, str(tmp_path / "large"), ga=1, batch=B * K, loss_type="apo_zero_unpaired")
    for order, cls in ORDERS.items():
        update = _train(cls, str(tmp_path / order), ga=K, batch=B, loss_type="apo_zero_unpaired")
        error = float((update - reference).norm() / reference.norm())
        assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"
