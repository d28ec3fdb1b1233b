"""Tiny offline pieces for the GRPO composition tests: prompts, a random-init Llama whose completions end at uneven
lengths, deterministic reward functions, and one training run that records its generations.

Every run trains with SGD(lr=1), no clipping, fp32 (TRL's configs default to `bf16=True`, which on CPU autocasts the
forward and backward to bf16 and puts every comparison at the 1e-3 level, so it is switched off), sequential prompts,
and `num_generations=4`. The large-batch reference is the stock `GRPOTrainer` at `gradient_accumulation_steps=1`
with `per_device_train_batch_size = b * K` and `steps_per_generation = spg / K`, so both runs generate the same
completions from the same prompts in one call (checked token by token) and split them the same way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from hf_gradaccum import GradAccumTrainer
from tests.composition_cases import WORDS, flat_trainable, tiny_llama, word_tokenizer

EOS_ID = 3
NUM_GENERATIONS = 4
MAX_COMPLETION_LENGTH = 10


def prompts(n: int = 24, seed: int = 0) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict(
        {"prompt": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) for _ in range(n)]}
    )


def grpo_model(eos_logit: float = 2.4) -> torch.nn.Module:
    """`tiny_llama()` (seed 0) with its EOS row of the LM head pointed along the mean final hidden state, so sampled
    completions stop after 1 to 10 tokens: micro-batches hold very different completion-token counts."""
    torch.manual_seed(0)
    model = tiny_llama()
    with torch.no_grad():
        probe = torch.randint(len(WORDS) // 2, model.config.vocab_size, (16, 12))
        hidden = model.model(input_ids=probe).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[EOS_ID] = eos_logit * hidden / hidden.norm() ** 2
    return model


def completion_length(completions: list[str], **kwargs: Any) -> list[float]:
    """Reward: the number of words in the completion."""
    return [float(len(c.split())) for c in completions]


def low_words(completions: list[str], **kwargs: Any) -> list[float]:
    """Reward: how many of the completion's words are among the first ten of the vocabulary."""
    low = set(WORDS[:10])
    return [float(sum(w in low for w in c.split())) for c in completions]


class RecordGenerations:
    """Keeps each generation batch's completions (ids and mask) as the trainer produced them, to check that two runs
    train on the same samples."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        record = {k: output[k].detach().clone() for k in ("completion_ids", "completion_mask")}
        self.__dict__.setdefault("recorded_generations", []).append(record)
        return output


class StockGRPO(RecordGenerations, GRPOTrainer):
    pass


class GradAccumFirstGRPO(RecordGenerations, GradAccumTrainer, GRPOTrainer):
    pass


class GRPOFirstGradAccum(RecordGenerations, GRPOTrainer, GradAccumTrainer):
    pass


GRPO_ORDERS = {"gradaccum_first": GradAccumFirstGRPO, "grpo_first": GRPOFirstGradAccum}


class StockRLOO(RecordGenerations, RLOOTrainer):
    pass


class GradAccumFirstRLOO(RecordGenerations, GradAccumTrainer, RLOOTrainer):
    pass


class RLOOFirstGradAccum(RecordGenerations, RLOOTrainer, GradAccumTrainer):
    pass


RLOO_ORDERS = {"gradaccum_first": GradAccumFirstRLOO, "rloo_first": RLOOFirstGradAccum}


def _settings(ga: int, batch: int, spg: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    settings = dict(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg if spg is not None else ga,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        max_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        bf16=False,
        shuffle_dataset=False,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return settings


def grpo_args(
    output_dir: str, *, ga: int, batch: int, spg: int | None = None, config_cls: type = GRPOConfig, **overrides: Any
) -> GRPOConfig:
    return config_cls(output_dir, **_settings(ga, batch, spg, overrides))


def rloo_args(output_dir: str, *, ga: int, batch: int, spg: int | None = None, **overrides: Any) -> RLOOConfig:
    # beta=0: with a KL term RLOO loads its reference model by the policy's name, which a model instance built here
    # does not have.
    return RLOOConfig(output_dir, **_settings(ga, batch, spg, {"beta": 0.0, **overrides}))


@dataclass
class GRPORun:
    update: torch.Tensor  # trained minus initial trainable weights (float64)
    generations: list[dict[str, torch.Tensor]]
    trainer: Any
    initial_state: dict[str, torch.Tensor]  # the model's weights before training


def train_grpo(trainer_cls, args: GRPOConfig, reward_funcs=(completion_length,), **trainer_kwargs: Any) -> GRPORun:
    model = grpo_model()
    trainer = trainer_cls(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=prompts(),
        processing_class=word_tokenizer(),
        **trainer_kwargs,
    )
    initial = flat_trainable(trainer.model)
    initial_state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    return GRPORun(flat_trainable(trainer.model) - initial, trainer.recorded_generations, trainer, initial_state)


def assert_same_generations(run: GRPORun, reference: GRPORun) -> None:
    """Both runs sampled the same completions, token by token (else the comparison of updates means nothing)."""
    assert len(run.generations) == len(reference.generations)
    for ours, ref in zip(run.generations, reference.generations, strict=True):
        for key in ("completion_ids", "completion_mask"):
            assert torch.equal(ours[key], ref[key]), f"the runs generated different {key}"


def relative_difference(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())
