"""What the loss of TRL's trainers that generate or rebuild their batch inside a micro-step is a mean over, so that
each micro-batch is weighted by it where its loss is computed (`losses/counting.py`).

| trainer | where the batch is built | TRL's loss on one micro-batch | items |
|---|---|---|---|
| GOLD (`trl.experimental`), IW-OPD | the loop hands the whole window (one generation batch, sampled `gradient_accumulation_steps` times); `_prepare_inputs` splits it into that many equal slices and generates for the on-policy ones | token sum / the `num_items_in_batch` it is handed (else the micro-batch's label tokens) | the handed window's label tokens, one share per slice, handed as the slice's own |
| A*-PO (`A2POTrainer`) | `_prepare_inputs` generates one completion per prompt of the micro-batch | mean over sequences of the squared regression error | sequences |
| SDPO | `_prepare_inputs` generates once per generation batch and buffers one micro-batch per step | `distillation_weight=1` (default): mean over sequences of each one's token mean; `0`: the policy loss of its `loss_type`; divided by `current_gradient_accumulation_steps` | sequences (`grpo`, `dr_grpo`, the distillation term), completion tokens (`bnpo`, `dapo`); both terms: sequences, the token-mean policy term weighted on its own |
| Online DPO | `training_step` generates two completions per prompt, computes the loss and back-propagates it itself (no `compute_loss`) | mean over prompts (pairs) | pairs, counted on the batch handed over |

GOLD and IW-OPD divide the divergence by the `num_items_in_batch` the Trainer counted on the batches it prefetched:
at `gradient_accumulation_steps = 1` that is the window's label tokens, the dataset completions' (an on-policy slice's
generated tokens are divided by the count of the completions they replace, as in GKD). Stock TRL at GA = K hands each
micro-step K times that (every prefetched batch is the whole window). Each micro-batch is weighted by a 1/K share of
the window's count and is handed that share: the window's loss is the sum of its slices' token sums over the window's
count, which is the loss of one batch. Which slices are on-policy is drawn per slice (`lmbda`), at stock GA = K as
here; with `lmbda` 0 or 1 every slice is the same kind, as in one batch.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ...config.arguments import gradaccum_option
from ...losses.composed_class import nearest_trainer_named
from ...losses.composition_error import CompositionError
from .grpo import COMPLETION_TOKENS, SEQUENCES, GenerationBatchAccumulation, LossItems

# Trainers whose loop hands `training_step` the whole window at every micro-step and whose `_prepare_inputs` splits
# it into `gradient_accumulation_steps` equal slices: their loss divides by the count they are handed.
HANDED_WINDOW_TRAINERS = ("GOLDTrainer", "IWOPDTrainer")
REBUILDING_TRAINERS = ("A2POTrainer", "SDPOTrainer", "OnlineDPOTrainer", *HANDED_WINDOW_TRAINERS)

# SDPO's policy loss types: what each averages over on one micro-batch (`_compute_policy_loss`).
SDPO_POLICY_ITEMS = {"grpo": SEQUENCES, "dr_grpo": SEQUENCES, "bnpo": COMPLETION_TOKENS, "dapo": COMPLETION_TOKENS}

# (trainer class name, loss) -> (how, what, fix): the composition registry's rows (integrations/registry.py).
REGISTRY_ROWS: dict[tuple[str, str], tuple[str, str, str | None]] = {
    ("GOLDTrainer", "*"): (
        "items",
        "label tokens of the window the loop hands over (each of its `gradient_accumulation_steps` slices weighted "
        "by an equal share, handed to the loss as its own): stock GOLD divides the divergence, offline or over "
        "generated tokens, by the window's count; on- or off-policy is drawn per slice, as at stock GA = K; the "
        "cross-tokenizer ULD loss, normalised per micro-batch, is refused",
        None,
    ),
    ("IWOPDTrainer", "*"): (
        "items",
        "label tokens of the window the loop hands over (each of its `gradient_accumulation_steps` slices weighted "
        "by an equal share, handed to the loss as its own): stock IW-OPD divides the loss over generated tokens by "
        "the window's count; on- or off-policy is drawn per slice, as at stock GA = K",
        None,
    ),
    ("A2POTrainer", "*"): (
        "items",
        "sequences (one generated completion per prompt, counted at the loss), with a tokenizer that pads on the "
        "left (right padding puts each micro-batch's completions at other positions than one batch would: refused)",
        None,
    ),
    ("SDPOTrainer", "*"): (
        "items",
        "sequences (the self-distillation loss, `distillation_weight=1`: a mean over sequences of each one's token "
        "mean); with `distillation_weight=0` the policy loss's items: sequences for 'grpo' and 'dr_grpo', "
        "completion tokens for 'bnpo' and 'dapo'; a mix of both terms: sequences, with a token-mean policy term "
        "weighted by its own count (integrations/trl/loss_terms.py)",
        None,
    ),
    ("OnlineDPOTrainer", "*"): (
        "items",
        "pairs (one per prompt, two completions generated in its `training_step`, which computes and "
        "back-propagates the loss itself), counted on the batch handed over",
        None,
    ),
}


def _refuse(trainer_name: str, why: str, fix: str) -> CompositionError:

    return CompositionError(
        f"GradAccumTrainer cannot make {trainer_name} exact under gradient accumulation: {why}. {fix}"
    )


class SequencesAtTheLoss:
    """
    A*-PO's rule: the loss is a mean over the rows `_prepare_inputs` built (one generated completion per prompt).

    Example:

    ```python
    >>> import torch
    >>> rule = SequencesAtTheLoss("A2POTrainer")
    >>> rule.present(None, {"input_ids": torch.zeros(3, 5)})[0]
    3
    ```
    """

    def __init__(self, trainer_name: str) -> None:
        self.trainer_name = trainer_name

    def __repr__(self) -> str:
        return f"SequencesAtTheLoss({self.trainer_name})"

    def present(self, trainer: Any, inputs: Any) -> tuple[float, Callable[[], None]]:
        """The rows of the batch the loss is about to see, and nothing to undo."""
        if not isinstance(inputs, dict) or "input_ids" not in inputs:
            raise RuntimeError(
                f"GradAccumTrainer expected {self.trainer_name}'s loss to receive the batch its `_prepare_inputs` "
                f"built (`input_ids` of prompts and completions), got {type(inputs).__name__}; this TRL release "
                "changed it, and composition with it is not supported (tested with trl==1.16)."
            )
        return int(inputs["input_ids"].shape[0]), lambda: None


class PairsInTrainingStep:
    """
    Online DPO's rule: its `training_step` generates, computes the loss (a mean over the batch's prompts, one pair
    each) and back-propagates it without `compute_loss`, so the micro-batch is counted on the batch handed over,
    before that step runs. Its step returns the loss divided by `gradient_accumulation_steps`, which is undone for the
    logged loss (the accumulator takes each micro-batch's own mean).

    Example:

    ```python
    >>> PairsInTrainingStep().count_handed({"prompt": ["a", "b"]})
    2
    ```
    """

    loss_inside_training_step = True

    def __repr__(self) -> str:
        return "PairsInTrainingStep(OnlineDPOTrainer)"

    def count_handed(self, inputs: Any) -> int:
        """The prompts of the batch handed to `training_step`: its loss is a mean over one pair per prompt."""
        if not isinstance(inputs, dict) or not isinstance(inputs.get("prompt"), list):
            raise RuntimeError(
                "GradAccumTrainer expected OnlineDPOTrainer to be handed a batch with a list of prompts, got "
                f"{type(inputs).__name__}; this TRL release changed it, and composition with it is not supported "
                "(tested with trl==1.16)."
            )
        return len(inputs["prompt"])

    def present(self, trainer: Any, inputs: Any) -> tuple[float, Callable[[], None]]:
        raise RuntimeError("OnlineDPOTrainer's `training_step` computes its loss without `compute_loss`.")

    @staticmethod
    def _online_dpo_class(trainer: Any) -> type:
        return next(c for c in type(trainer).__mro__ if c.__name__ == "OnlineDPOTrainer")

    def route_training_step(self, trainer: Any, accumulating_cls: type) -> None:
        """
        Where Online DPO precedes `accumulating_cls` in the class order, its `training_step` (which does not call
        `super()`) is the one the loop would call, and no micro-batch would reach the accumulator: an instance
        attribute routes the loop's calls through `accumulating_cls.training_step`, which runs Online DPO's step
        ([`parent_step`]) as its parent's.
        """
        online_dpo = self._online_dpo_class(trainer)
        if type(trainer).__mro__.index(online_dpo) < type(trainer).__mro__.index(accumulating_cls):
            trainer.training_step = types.MethodType(accumulating_cls.training_step, trainer)

    def parent_step(self, trainer: Any, model: Any, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """Online DPO's own `training_step` on `inputs`, in either class order."""
        return self._online_dpo_class(trainer).training_step(trainer, model, inputs, num_items_in_batch)

    def returned_loss(self, trainer: Any, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's own mean loss from what its `training_step` returned."""
        return loss * trainer.args.gradient_accumulation_steps


def handed_window_share(trainer: Any) -> int:
    """
    What the count of the batch handed to `trainer`'s `training_step` is divided by for one micro-batch:
    `gradient_accumulation_steps` where the loop hands the whole window at every micro-step (`HANDED_WINDOW_TRAINERS`),
    else 1.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> handed_window_share(GradAccumTrainer)
    1
    ```
    """
    if nearest_trainer_named(trainer, HANDED_WINDOW_TRAINERS) is None:
        return 1
    return trainer.args.gradient_accumulation_steps


def rebuilt_batch_accumulation_for(trainer: Any) -> Any | None:
    """
    The rule that counts the items of a trainer composed with A*-PO, SDPO or Online DPO where its loss is (see the
    module table); `None` for any other trainer (GOLD and IW-OPD are weighted by the count of the batch handed over,
    [`handed_window_share`]). Raises a `CompositionError` (a `ValueError`) naming the trainer and the fix where the
    loss cannot be made exact or counted, before any work.

    Example:

    ```python
    >>> rebuilt_batch_accumulation_for(trainer)  # doctest: +SKIP  (composed with A2POTrainer)
    SequencesAtTheLoss(A2POTrainer)
    ```
    """
    name = nearest_trainer_named(trainer, REBUILDING_TRAINERS)
    if name is None:
        return None
    args = trainer.args
    if args.gradient_accumulation_steps > 1:
        if args.auto_find_batch_size:
            raise _refuse(
                name,
                "`auto_find_batch_size=True` redoes a window in smaller chunks after an out-of-memory error, which "
                "would generate again or split the batch its `_prepare_inputs` slices",
                "Set `auto_find_batch_size=False` and choose `per_device_train_batch_size` yourself.",
            )
        if gradaccum_option(args, "verify_accumulation") != "off":
            raise _refuse(
                name,
                "the split-invariance check needs model-ready micro-batches, and this trainer builds them itself",
                "Set `verify_accumulation='off'`; its weighting is known exact (hf_gradaccum/integrations/trl/generating.py).",
            )
    if (
        name == "GOLDTrainer"
        and args.gradient_accumulation_steps > 1
        and getattr(trainer, "use_uld_loss", False)
        and getattr(trainer, "teacher_tokenizer", None) is not None
    ):
        raise _refuse(
            name,
            "its cross-tokenizer ULD loss (`use_uld_loss=True` with a teacher tokenizer) is normalised within each "
            "micro-batch and ignores the count it is handed",
            "Use a teacher that shares the student's tokenizer (the JSD loss), or `gradient_accumulation_steps=1` "
            "with the batch you want.",
        )
    if name in HANDED_WINDOW_TRAINERS:
        return None
    if name == "A2POTrainer":
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        if args.gradient_accumulation_steps > 1 and getattr(tokenizer, "padding_side", "left") != "left":
            raise _refuse(
                name,
                "it pads each micro-batch's prompts with the tokenizer it is given, which pads on the right: a "
                "completion then starts after its micro-batch's longest prompt, at other positions than in one "
                "batch of the whole window",
                "Pass a tokenizer with `padding_side='left'` (A2POTrainer loads one so when it loads it itself).",
            )
        return SequencesAtTheLoss(name)
    if name == "OnlineDPOTrainer":
        if args.gradient_accumulation_steps > 1 and (
            args.fp16 or (args.bf16 and gradaccum_option(args, "bf16_loss_scaling"))
        ):
            raise _refuse(
                name,
                "loss scaling redoes an overflowing micro-batch's `compute_loss`, and its `training_step` computes "
                "and back-propagates its loss without one",
                "Train in bf16 without `bf16_loss_scaling` or in fp32, or use `gradient_accumulation_steps=1`.",
            )
        return PairsInTrainingStep()
    return _sdpo_accumulation(trainer)


def _sdpo_accumulation(trainer: Any) -> GenerationBatchAccumulation:
    args = trainer.args
    weight = args.distillation_weight
    policy = SDPO_POLICY_ITEMS.get(args.loss_type)
    if weight == 1.0:
        items = SEQUENCES
    elif policy is None:
        raise _refuse(
            "SDPOTrainer",
            f"its policy loss type {args.loss_type!r} is not in GradAccumTrainer's table of what each averages over",
            "Use one of " + ", ".join(repr(t) for t in SDPO_POLICY_ITEMS) + ".",
        )
    elif weight == 0.0 or policy == SEQUENCES:
        items = policy
    elif args.steps_per_generation == args.gradient_accumulation_steps:
        # The self-distillation term's sequences; the policy term (a token mean) gets a weight of its own from the
        # window's buffered generation batch (`integrations/trl/loss_terms.py`).
        items = SEQUENCES
    else:
        raise _refuse(
            "SDPOTrainer",
            f"with `distillation_weight={weight}` its loss mixes the self-distillation term (a mean over sequences) "
            f"with the {args.loss_type!r} policy loss (a mean over the micro-batch's completion tokens), whose weight "
            "is taken from the window's generation batch, and with `steps_per_generation != "
            "gradient_accumulation_steps` that batch is not the window",
            "Set `steps_per_generation` equal to `gradient_accumulation_steps`, use `loss_type='grpo'` or "
            "`'dr_grpo'` with a mixed loss, or `gradient_accumulation_steps=1` with the batch you want.",
        )
    return GenerationBatchAccumulation("SDPOTrainer", args.loss_type, LossItems(items))
