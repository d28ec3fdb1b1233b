"""The TRL zoo: every trainer TRL 1.16 ships (stable and `trl.experimental`), each composed with `GradAccumTrainer` in
both class orders at `gradient_accumulation_steps = K`, against the same trainer, stock, at GA = 1 on the whole
window (one SGD(lr=1) step, fp32, tiny random-init Llama models, the same samples in the same order).

Generating trainers get a deterministic generation stand-in (`DeterministicCompletions`): each prompt's completion is
a function of its own tokens only, so the run at GA = 1 (one batch of B x K rows) and the runs at GA = K (K batches of
B rows) train on the same completions, whatever the batch composition and the random state. The stand-in replaces
the trainer's generation method only; everything after it (labels, masks, the loss) is the trainer's own.

`run_case` classifies one composed run: `exact` (relative update difference <= 1e-5 against the stock GA = 1 run),
`refused` (a `CompositionError` before the first optimizer step; its first line kept), `silent` (trained, not
exact) or `crashed` (any other exception).
"""

from __future__ import annotations

import functools
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from hf_gradaccum import GradAccumTrainer
from hf_gradaccum.integrations.registry import CompositionError
from tests.composition_cases import WORDS, flat_trainable, tiny_llama, word_tokenizer

RTOL = 1e-5
B, K = 2, 3
EOS_ID = 3
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)


def tokenizer():
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def messages_dataset(n: int = B * K, seed: int = 5) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": _sentence(rng, 1, 6)},
                    {"role": "assistant", "content": _sentence(rng, 1, 7)},
                ]
                for _ in range(n)
            ]
        }
    )


def prompt_dataset(n: int = B * K, seed: int = 6) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict({"prompt": [_sentence(rng, 1, 5) for _ in range(n)]})


def prompt_completion_dataset(n: int = B * K, seed: int = 7) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict(
        {"prompt": [_sentence(rng, 1, 5) for _ in range(n)], "completion": [_sentence(rng, 1, 6) for _ in range(n)]}
    )


def preference_dataset(
    n: int = B * K, seed: int = 8, reference: bool = False, same_length: bool = False
) -> datasets.Dataset:
    """Preference rows; `same_length`: every completion 4 words, so that a tiny random model's log-ratios are not
    ranked by the completions' lengths alone."""
    rng = random.Random(seed)
    lo, hi = (4, 4) if same_length else (1, 6)
    rows = {
        "prompt": [_sentence(rng, 1, 5) for _ in range(n)],
        "chosen": [_sentence(rng, lo, hi) for _ in range(n)],
        "rejected": [_sentence(rng, lo, hi) for _ in range(n)],
    }
    if reference:
        rows["reference"] = [_sentence(rng, 1, 6) for _ in range(n)]
    return datasets.Dataset.from_dict(rows)


@functools.cache
def _tokenizer_dir() -> str:
    """A directory holding the word tokenizer and the seed-0 tiny Llama, for trainers that load a tokenizer or a teacher
    by the model's `_name_or_path` (IW-OPD, GOLD, SDFT, SDPO)."""
    path = tempfile.mkdtemp(prefix="trl_zoo_model_")
    tokenizer().save_pretrained(path)
    torch.manual_seed(0)
    tiny_llama().save_pretrained(path)
    return path


def student(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tiny_llama()
    model.config._name_or_path = _tokenizer_dir()
    return model


def teacher() -> torch.nn.Module:
    return student(seed=1)


def completion_of(prompt_ids: list[int]) -> list[int]:
    """The stand-in's completion: 1 to 6 word tokens then EOS, a function of the prompt's tokens only."""
    total = sum(prompt_ids)
    length = 1 + total % 6
    return [4 + (total * 7 + 11 * j) % len(WORDS) for j in range(length)] + [EOS_ID]


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Reward: the completion's length in characters (deterministic)."""
    return [float(len(str(c))) for c in completions]


class DeterministicCompletions:
    """GKD's generation stand-in (`generate_on_policy_outputs`): the trainer's own masking of prompt, completion and
    padding, applied to `completion_of(prompt)` instead of sampled tokens."""

    @staticmethod
    def generate_on_policy_outputs(model, inputs, generation_config):
        prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
        completions = [
            completion_of(row[mask.bool()].tolist()) for row, mask in zip(prompts, prompt_mask, strict=True)
        ]
        width = max(len(c) for c in completions)
        completion_ids = torch.zeros((len(completions), width), dtype=prompts.dtype, device=prompts.device)
        completion_mask = torch.zeros_like(completion_ids)
        for i, c in enumerate(completions):
            completion_ids[i, : len(c)] = torch.tensor(c)
            completion_mask[i, : len(c)] = 1
        generated = torch.cat([prompts, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        labels = generated.clone()
        labels[attention_mask == 0] = -100
        labels[:, : prompts.shape[1]] = -100
        return generated, attention_mask, labels


def _deterministic_generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
    """`model.generate` of `DeterministicGeneration`: each left-padded prompt row gets `completion_of` its own tokens
    (the n-th repeat of a prompt within one call gets the n-th variant, so that the copies of a prompt that a trainer
    samples twice differ), padded on the right to `max_new_tokens` with the pad token, as sampling would leave it."""
    config = generation_config or self.generation_config
    repeats = getattr(config, "num_return_sequences", None) or 1
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    input_ids, attention_mask = input_ids.repeat_interleave(repeats, 0), attention_mask.repeat_interleave(repeats, 0)
    width = config.max_new_tokens
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    completions = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype, device=input_ids.device)
    seen: dict[tuple[int, ...], int] = {}
    for i, (row, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
        prompt = tuple(row[mask.bool()].tolist())
        variant = seen.get(prompt, 0)
        seen[prompt] = variant + 1
        tokens = completion_of([*prompt, 4 + variant] if variant else list(prompt))[:width]
        completions[i, : len(tokens)] = torch.tensor(tokens)
    sequences = torch.cat([input_ids, completions], dim=1)
    if kwargs.get("return_dict_in_generate"):
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


class DeterministicGeneration:
    """Generation stand-in at the model: the trainer's `model` (and every copy of it, such as a reference model) gets
    a `generate` that returns `completion_of(prompt)` for each row, so that trainers that sample through
    `model.generate` per micro-batch (A*-PO, IW-OPD, GOLD, Online DPO) train on the same completions at GA = 1 and
    GA = K. Everything after `generate` (masks, labels, rewards, the loss) is the trainer's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        kwargs["model"] = model
        model.__class__ = type(
            f"Deterministic{type(model).__name__}", (type(model),), {"generate": _deterministic_generate}
        )
        super().__init__(*args, **kwargs)


class LeftPaddingTokenizer:
    """The tokenizer pads on the left, as A*-PO's own when it loads one: it pads each micro-batch's prompts itself,
    and right padding would put the completions of shorter prompts at other positions in a wider batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["processing_class"].padding_side = "left"
        super().__init__(*args, **kwargs)


COMMON = dict(
    learning_rate=1.0,
    optim="sgd",
    lr_scheduler_type="constant",
    max_grad_norm=0.0,
    weight_decay=0.0,
    max_steps=1,
    bf16=False,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
    train_sampling_strategy="sequential",
)


@dataclass
class ZooCase:
    """One trainer and loss variant of the zoo.

    Args:
        trainer: `module:Class` of the TRL trainer.
        variant: the loss variant (a short label).
        config: `module:Class` of its config.
        settings: config fields of the variant.
        build: `build()` -> the trainer's keyword arguments other than `args` (model, datasets, teacher, ...).
        mixins: stand-ins put in front of every class (stock and composed), e.g. a deterministic generation.
        batch_settings: `batch_settings(ga, batch)` -> the config fields that set the window (default: the micro-batch
            size and the accumulation steps).
        fast: in the default test run (the rest of the zoo is `slow`).
        expect: `"exact"` or `"refused"`, what the composed runs must be.
    """

    trainer: str
    variant: str
    config: str
    settings: dict[str, Any]
    build: Callable[[], dict[str, Any]]
    mixins: tuple[type, ...] = ()
    batch_settings: Callable[[int, int], dict[str, Any]] | None = None
    fast: bool = False
    expect: str = "exact"

    @property
    def name(self) -> str:
        return self.trainer.rsplit(":", 1)[1]


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(__import__(module, fromlist=[name]), name)


def _window(ga: int, batch: int) -> dict[str, Any]:
    return {"per_device_train_batch_size": batch, "gradient_accumulation_steps": ga}


def _generation_window(ga: int, batch: int) -> dict[str, Any]:
    return {"per_device_train_batch_size": batch, "gradient_accumulation_steps": ga, "steps_per_generation": ga}


def classes(case: ZooCase) -> dict[str, type]:
    """The stock class and the two composed class orders (with the case's stand-ins in front)."""
    stock = _load(case.trainer)
    mixins = case.mixins
    return {
        "stock": type(f"Stock{case.name}", (*mixins, stock), {}),
        "gradaccum_first": type(f"GradAccumFirst{case.name}", (*mixins, GradAccumTrainer, stock), {}),
        "trl_first": type(f"{case.name}FirstGradAccum", (*mixins, stock, GradAccumTrainer), {}),
    }


def train_once(case: ZooCase, cls: type, output_dir: str, ga: int, batch: int) -> torch.Tensor:
    """Build `cls` for `case` at (`ga`, `batch`), train one step; the trainable weights' update (float64)."""
    config_cls = _load(case.config)
    window = (case.batch_settings or _window)(ga, batch)
    args = config_cls(output_dir, **{**COMMON, **case.settings, **window})
    trainer = cls(args=args, **case.build())
    initial = flat_trainable(trainer.model)
    trainer.train()
    return flat_trainable(trainer.model) - initial


@dataclass
class ZooResult:
    case: ZooCase
    order: str
    verdict: str  # exact / refused / silent / crashed
    error: float | None = None  # relative update difference against stock GA = 1
    message: str = ""


def relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


def run_case(case: ZooCase, order: str, reference: Callable[[], torch.Tensor], output_dir: str) -> ZooResult:
    """One composed run of `case` in class `order`, classified against the stock GA = 1 update (`reference()`,
    computed only for a run that trains)."""
    try:
        update = train_once(case, classes(case)[order], output_dir, K, B)
    except CompositionError as e:
        return ZooResult(case, order, "refused", message=str(e).splitlines()[0])
    except Exception as e:  # classified, not raised: the zoo reports every trainer
        return ZooResult(case, order, "crashed", message=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    error = relative(update, reference())
    return ZooResult(case, order, "exact" if error <= RTOL else "silent", error=error)


def stock_reference(case: ZooCase, output_dir: str) -> Callable[[], torch.Tensor]:
    """The stock trainer's update at GA = 1 on the whole window (B x K rows), computed once on first use."""

    @functools.cache
    def reference() -> torch.Tensor:
        return train_once(case, classes(case)["stock"], output_dir, 1, B * K)

    return reference


def gkd_build() -> dict[str, Any]:
    return dict(
        model=student(), teacher_model=teacher(), train_dataset=messages_dataset(), processing_class=tokenizer()
    )


_GKD = dict(trainer="trl.experimental.gkd:GKDTrainer", config="trl.experimental.gkd:GKDConfig", build=gkd_build)
_GKD_SETTINGS = dict(max_new_tokens=7, temperature=1.0)

CASES: list[ZooCase] = [
    ZooCase(variant="offline (lmbda=0)", settings={**_GKD_SETTINGS, "lmbda": 0.0}, **_GKD),
    ZooCase(
        variant="on-policy (lmbda=1)",
        settings={**_GKD_SETTINGS, "lmbda": 1.0},
        mixins=(DeterministicCompletions,),
        fast=True,
        **_GKD,
    ),
    ZooCase(
        variant="seq_kd",
        settings={**_GKD_SETTINGS, "lmbda": 0.0, "seq_kd": True},
        mixins=(DeterministicCompletions,),
        **_GKD,
    ),
]


def _grpo_model() -> torch.nn.Module:
    """The GRPO tests' tiny Llama, whose sampled completions stop after 1 to 10 tokens (uneven micro-batches)."""
    from tests.grpo_cases import grpo_model

    model = grpo_model()
    model.config._name_or_path = _tokenizer_dir()
    return model


def rl_build() -> dict[str, Any]:
    return dict(
        model=_grpo_model(), reward_funcs=[length_reward], train_dataset=prompt_dataset(), processing_class=tokenizer()
    )


def distillation_build() -> dict[str, Any]:
    return dict(
        model=_grpo_model(), teacher_model=teacher(), train_dataset=prompt_dataset(), processing_class=tokenizer()
    )


def teacher_prompt_build() -> dict[str, Any]:
    return dict(
        model=student(), teacher_model=teacher(), train_dataset=messages_dataset(), processing_class=tokenizer()
    )


def preference_build(reference: bool = False, other_reference: bool = False) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        kwargs = dict(
            model=student(),
            train_dataset=preference_dataset(reference=reference, same_length=other_reference),
            processing_class=tokenizer(),
        )
        if other_reference:
            # Another initialisation with a sharper head, on completions of one length: a tiny random model's
            # log-probabilities are mostly the completion's length, which would rank the reference's log-ratios as
            # the policy's.
            reference_model = student(seed=1)
            with torch.no_grad():
                reference_model.lm_head.weight.mul_(30.0)
            kwargs["ref_model"] = reference_model
        return kwargs

    return build


def privileged_build() -> dict[str, Any]:
    rng = random.Random(9)
    rows = prompt_dataset().to_dict()
    rows["privileged_context"] = [_sentence(rng, 1, 4) for _ in rows["prompt"]]
    return dict(model=_grpo_model(), train_dataset=datasets.Dataset.from_dict(rows), processing_class=tokenizer())


def sdpo_build() -> dict[str, Any]:
    return {**privileged_build(), "reward_funcs": [length_reward]}


def online_dpo_build() -> dict[str, Any]:
    return dict(
        model=student(), reward_funcs=[length_reward], train_dataset=prompt_dataset(), processing_class=tokenizer()
    )


_RL = dict(num_generations=2, max_completion_length=6, shuffle_dataset=False)
_X = "trl.experimental"

CASES += [
    ZooCase(
        trainer=f"{_X}.gmpo:GMPOTrainer",
        config=f"{_X}.gmpo:GMPOConfig",
        variant="default",
        settings={**_RL},
        build=rl_build,
        batch_settings=_generation_window,
        fast=True,
    ),
    ZooCase(
        trainer="trl:DistillationTrainer",
        config="trl:DistillationConfig",
        variant="on-policy",
        settings={"max_completion_length": 6, "shuffle_dataset": False},
        build=distillation_build,
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.distillation:DistillationTrainer",
        config=f"{_X}.distillation:DistillationConfig",
        variant="on-policy (experimental)",
        settings={"max_completion_length": 6, "shuffle_dataset": False},
        build=distillation_build,
    ),
    ZooCase(
        trainer=f"{_X}.tpo:TPOTrainer",
        config=f"{_X}.tpo:TPOConfig",
        variant="tpo_alpha=0",
        settings={"tpo_alpha": 0.0},
        build=preference_build(reference=True),
    ),
    ZooCase(
        trainer=f"{_X}.tpo:TPOTrainer",
        config=f"{_X}.tpo:TPOConfig",
        variant="tpo_alpha=1",
        settings={"tpo_alpha": 1.0},
        build=preference_build(reference=True),
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.cpo:CPOTrainer",
        config=f"{_X}.cpo:CPOConfig",
        variant="sigmoid",
        settings={},
        build=preference_build(),
    ),
    ZooCase(
        trainer=f"{_X}.cpo:CPOTrainer",
        config=f"{_X}.cpo:CPOConfig",
        variant="simpo, cpo_alpha=1",
        settings={"loss_type": "simpo", "cpo_alpha": 1.0},
        build=preference_build(),
    ),
    ZooCase(
        trainer=f"{_X}.cpo:CPOTrainer",
        config=f"{_X}.cpo:CPOConfig",
        variant="simpo",
        settings={"loss_type": "simpo"},
        build=preference_build(),
    ),
    ZooCase(
        trainer=f"{_X}.orpo:ORPOTrainer",
        config=f"{_X}.orpo:ORPOConfig",
        variant="default",
        settings={},
        build=preference_build(),
    ),
    ZooCase(
        trainer=f"{_X}.gold:GOLDTrainer",
        config=f"{_X}.gold:GOLDConfig",
        variant="offline (lmbda=0)",
        settings={"lmbda": 0.0, "max_completion_length": 6, "use_extended_uld": False},
        build=gkd_build,
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.iw_opd:IWOPDTrainer",
        mixins=(DeterministicGeneration,),
        config=f"{_X}.iw_opd:IWOPDConfig",
        variant="default",
        settings={"max_completion_length": 6},
        build=teacher_prompt_build,
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.sdft:SDFTTrainer",
        config=f"{_X}.sdft:SDFTConfig",
        variant="default",
        settings={"max_completion_length": 6, "num_generations": 2, "distillation_topk": 8},
        build=privileged_build,
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.sdpo:SDPOTrainer",
        config=f"{_X}.sdpo:SDPOConfig",
        variant="default",
        settings={**_RL},
        build=sdpo_build,
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.a2po:A2POTrainer",
        mixins=(DeterministicGeneration, LeftPaddingTokenizer),
        config=f"{_X}.a2po:A2POConfig",
        variant="default",
        settings={"max_completion_length": 6},
        build=rl_build,
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.online_dpo:OnlineDPOTrainer",
        mixins=(DeterministicGeneration,),
        config=f"{_X}.online_dpo:OnlineDPOConfig",
        variant="default",
        settings={"max_new_tokens": 6},
        build=online_dpo_build,
        fast=True,
    ),
]


def kto_dataset(n: int = B * K, seed: int = 10) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict(
        {
            "prompt": [_sentence(rng, 1, 5) for _ in range(n)],
            "completion": [_sentence(rng, 1, 6) for _ in range(n)],
            "label": [i % 3 != 0 for i in range(n)],
        }
    )


def sft_build() -> dict[str, Any]:
    return dict(model=student(), train_dataset=prompt_completion_dataset(), processing_class=tokenizer())


def reward_build() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tiny_llama().config.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=0,
    )
    return dict(
        model=LlamaForSequenceClassification(config), train_dataset=preference_dataset(), processing_class=tokenizer()
    )


def kto_build() -> dict[str, Any]:
    return dict(model=student(), ref_model=student(), train_dataset=kto_dataset(), processing_class=tokenizer())


# The stable trainers (their own tests compare them with hand-computed large batches; here, with the stock trainer).
CASES += [
    ZooCase(
        trainer="trl:SFTTrainer", config="trl:SFTConfig", variant="prompt-completion", settings={}, build=sft_build
    ),
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="sigmoid",
        settings={},
        build=preference_build(),
    ),
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="sft",
        settings={"loss_type": ["sft"]},
        build=preference_build(),
    ),
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="sigmoid + sft (RPO)",
        settings={"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
        build=preference_build(),
        fast=True,
    ),
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="aot",
        settings={"loss_type": ["aot"]},
        build=preference_build(),
    ),
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="aot_unpaired",
        settings={"loss_type": ["aot_unpaired"]},
        build=preference_build(),
    ),
    # With the policy equal to its reference (step 0 above) every log-ratio is 0 and any pairing of ranks gives the
    # same step; with another reference the ranks matter, and stock at GA = 3 is not the large batch.
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="aot, another reference",
        settings={"loss_type": ["aot"]},
        build=preference_build(other_reference=True),
    ),
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant="aot_unpaired, another reference",
        settings={"loss_type": ["aot_unpaired"]},
        build=preference_build(other_reference=True),
        fast=True,
    ),
    ZooCase(
        trainer=f"{_X}.bema_for_ref_model:DPOTrainer",
        config="trl:DPOConfig",
        variant="sigmoid (BEMA reference)",
        settings={},
        build=preference_build(),
    ),
    ZooCase(trainer="trl:RewardTrainer", config="trl:RewardConfig", variant="pairs", settings={}, build=reward_build),
    ZooCase(
        trainer="trl:KTOTrainer",
        config="trl:KTOConfig",
        variant="kto",
        settings={"max_length": 32},
        build=kto_build,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="grpo",
        settings={**_RL, "loss_type": "grpo"},
        build=rl_build,
        batch_settings=_generation_window,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="bnpo",
        settings={**_RL, "loss_type": "bnpo"},
        build=rl_build,
        batch_settings=_generation_window,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="grpo + entropy_coef",
        settings={**_RL, "loss_type": "grpo", "entropy_coef": 0.1},
        build=rl_build,
        batch_settings=_generation_window,
        fast=True,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="dr_grpo + entropy_coef",
        settings={**_RL, "loss_type": "dr_grpo", "entropy_coef": 0.1},
        build=rl_build,
        batch_settings=_generation_window,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="top_entropy_quantile=0.5",
        settings={**_RL, "loss_type": "bnpo", "top_entropy_quantile": 0.5},
        build=rl_build,
        batch_settings=_generation_window,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="top_entropy_quantile=0.5 + entropy_coef",
        settings={**_RL, "loss_type": "grpo", "top_entropy_quantile": 0.5, "entropy_coef": 0.1},
        build=rl_build,
        batch_settings=_generation_window,
    ),
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant="dapo, top_entropy_quantile=0.5 + entropy_coef",
        settings={**_RL, "loss_type": "dapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.1},
        build=rl_build,
        batch_settings=_generation_window,
    ),
    ZooCase(
        trainer="trl:RLOOTrainer",
        config="trl:RLOOConfig",
        variant="default",
        settings={**_RL, "beta": 0.0},
        build=rl_build,
        batch_settings=_generation_window,
    ),
]

# Trainers that generate or rebuild their batch in a micro-step, beyond the defaults above.
CASES += [
    ZooCase(
        trainer=f"{_X}.gold:GOLDTrainer",
        config=f"{_X}.gold:GOLDConfig",
        variant="on-policy (lmbda=1)",
        settings={"lmbda": 1.0, "max_completion_length": 6, "use_extended_uld": False},
        build=gkd_build,
        mixins=(DeterministicGeneration,),
    ),
    ZooCase(
        trainer=f"{_X}.a2po:A2POTrainer",
        config=f"{_X}.a2po:A2POConfig",
        variant="right-padding tokenizer",
        settings={"max_completion_length": 6},
        build=rl_build,
        mixins=(DeterministicGeneration,),
        expect="refused",
    ),
    ZooCase(
        trainer=f"{_X}.sdpo:SDPOTrainer",
        config=f"{_X}.sdpo:SDPOConfig",
        variant="policy loss (distillation_weight=0, dapo)",
        settings={**_RL, "distillation_weight": 0.0, "loss_type": "dapo"},
        build=sdpo_build,
    ),
    ZooCase(
        trainer=f"{_X}.sdpo:SDPOTrainer",
        config=f"{_X}.sdpo:SDPOConfig",
        variant="mixed (distillation_weight=0.5, dapo)",
        settings={**_RL, "distillation_weight": 0.5, "loss_type": "dapo"},
        build=sdpo_build,
    ),
]

# Every other loss option of the preference and RL trainers (the zoo's `slow` part): each loss type as a user would
# pick it, with the settings it needs to be defined (a label smoothing for `exo_pair` and `robust`).
_DPO_LOSS_TYPES = (
    "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop",
    "sigmoid_norm",
)  # fmt: skip
_SMOOTHED = {"exo_pair": 0.1, "robust": 0.1}
CASES += [
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant=loss_type,
        settings={
            "loss_type": [loss_type],
            **({"label_smoothing": _SMOOTHED[loss_type]} if loss_type in _SMOOTHED else {}),
        },
        build=preference_build(other_reference=True),
    )
    for loss_type in _DPO_LOSS_TYPES
]
CASES += [
    ZooCase(
        trainer="trl:DPOTrainer",
        config="trl:DPOConfig",
        variant=variant,
        settings=settings,
        build=preference_build(other_reference=True),
    )
    for variant, settings in {
        "MPO (sigmoid + bco_pair + sft)": {
            "loss_type": ["sigmoid", "bco_pair", "sft"],
            "loss_weights": [0.8, 0.2, 1.0],
        },
        "aot + sft": {"loss_type": ["aot", "sft"]},
        "ipo, another reference": {"loss_type": ["ipo"]},
    }.items()
]
CASES += [
    ZooCase(
        trainer=f"{_X}.cpo:CPOTrainer",
        config=f"{_X}.cpo:CPOConfig",
        variant=f"{loss_type}, cpo_alpha={alpha}",
        settings={"loss_type": loss_type, "cpo_alpha": alpha},
        build=preference_build(),
    )
    for loss_type in ("hinge", "ipo", "alphapo")
    for alpha in (0.0, 1.0)
]
CASES += [
    ZooCase(
        trainer=f"{_X}.tpo:TPOTrainer",
        config=f"{_X}.tpo:TPOConfig",
        variant=f"{loss_type}, tpo_alpha=1",
        settings={"loss_type": loss_type, "tpo_alpha": 1.0},
        build=preference_build(reference=True),
    )
    for loss_type in ("hinge", "ipo", "tpo-l")
]
CASES += [
    ZooCase(
        trainer="trl:GRPOTrainer",
        config="trl:GRPOConfig",
        variant=variant,
        settings={**_RL, **settings},
        build=rl_build,
        batch_settings=_generation_window,
    )
    for variant, settings in {
        "dr_grpo": {"loss_type": "dr_grpo"},
        "dapo": {"loss_type": "dapo"},
        "cispo": {"loss_type": "cispo"},
        "sapo": {"loss_type": "sapo"},
        "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        "dapo + entropy_coef": {"loss_type": "dapo", "entropy_coef": 0.1},
        "sapo + entropy_coef": {"loss_type": "sapo", "entropy_coef": 0.1},
        "grpo, beta=0.1": {"loss_type": "grpo", "beta": 0.1},
        "dapo, top_entropy_quantile=0.2": {"loss_type": "dapo", "top_entropy_quantile": 0.2},
    }.items()
]
CASES += [
    ZooCase(
        trainer="trl:KTOTrainer",
        config="trl:KTOConfig",
        variant="apo_zero_unpaired",
        settings={"max_length": 32, "loss_type": "apo_zero_unpaired"},
        build=kto_build,
    ),
]

# Shipped by TRL 1.16 but not constructible offline on a CPU (they need a model name to load, a vLLM or teacher
# server): listed in the zoo's table, not run.
NOT_RUN = {
    "trl.experimental.async_grpo:AsyncGRPOTrainer": "needs a vLLM server (`model` must be a name)",
    "trl.experimental.async_distillation:AsyncDistillationTrainer": "needs a vLLM server (`model` must be a name)",
    "trl.experimental.server_distillation:ServerDistillationTrainer": "needs a teacher server",
}
