"""What each loss of TRL's online RL trainers (`GRPOTrainer`, `RLOOTrainer`) averages over, so that their micro-batches
can be weighted like one large batch.

These trainers hand `training_step` a *generation batch* (a list of prompt rows) and their own `_prepare_inputs`
generates completions for `steps_per_generation` micro-batches at once, buffers them, and returns one buffered
micro-batch per call. The adapter lets that run untouched; this module only says, for the micro-batch the loss is
about to see, how many items its loss is a mean over, and presents it to TRL's loss as a batch of its own:

| trainer, `loss_type` | TRL's loss on one micro-batch (with `current_gradient_accumulation_steps=1`) | items |
|---|---|---|
| GRPO `grpo`, `sapo` | mean over sequences of each sequence's token mean | sequences |
| GRPO `dr_grpo` | sum over tokens / (sequences x `max_completion_length`) | sequences |
| GRPO `luspo` | mean over sequences of each sequence's token sum | sequences |
| GRPO `bnpo` | mean over the micro-batch's completion tokens | completion tokens |
| GRPO `dapo`, `cispo`, `vespo` | token sum / `num_items_in_batch` rescaled to one micro-batch (see below) | completion tokens (see below) |
| RLOO | mean over sequences | sequences |
| GMPO (`trl.experimental`, any `loss_type`) | mean over sequences of the geometric-mean term | sequences |
| Distillation | token sum / the generation batch's tokens per rank (presented as the micro-batch's own) | completion tokens |
| SDFT (`trl.experimental`, local teacher) | mean over sequences of each sequence's token mean | sequences |

Weighting micro-batch k by its items `n_k` and dividing by the window's items (all ranks) gives the mean over all
of the window's sequences (or tokens): the loss of one batch of `per_device_train_batch_size x
gradient_accumulation_steps` (x ranks). For `bnpo` that is the token mean over the whole batch, which stock TRL
under accumulation does not give (it averages per-micro-batch token means).

`dapo`, `cispo` and `vespo` divide by `inputs["num_items_in_batch"]`, the completion tokens of the whole generation
batch on all ranks, rescaled by `current_gradient_accumulation_steps / (steps_per_generation * num_processes)`:

- with `steps_per_generation == gradient_accumulation_steps` (TRL's default) the generation batch is the window, and
  TRL's large batch is the token mean over the window. For the length of the loss computation the micro-batch's
  `num_items_in_batch` is set to `n_k x num_processes x steps_per_generation`, so that TRL's divisor is exactly
  `n_k`, the micro-batch's own tokens, and the loss is its token mean like `bnpo`'s. The entropy bonus is a token
  mean over the same tokens, so it is exact too;
- otherwise TRL divides every step of a generation batch by the same count, its tokens per step and rank
  (`num_items_in_batch / (num_processes x steps_per_generation)`), and that is what each micro-batch's loss is a mean
  over, so each is weighted by it. The entropy bonus (a mean over the micro-batch's own tokens) then needs a
  different weight and is refused.

Refused (a `CompositionError`, a `ValueError`, at construction, when `gradient_accumulation_steps > 1`), because no weighting of
micro-batches reproduces them on the large batch:

- the adaptive entropy bonus (`use_adaptive_entropy`) with a per-sequence loss, or any entropy bonus with `dapo`,
  `cispo`, `vespo`, or a per-sequence loss, when `steps_per_generation != gradient_accumulation_steps`: its token
  mean and the policy's mean need different weights (a static `entropy_coef` beside a per-sequence loss gets a weight
  of its own: `integrations/trl/loss_terms.py`);
- `top_entropy_quantile < 1` where the window is not one generation batch, or beside an entropy bonus (the
  quantile itself is taken over the window: `integrations/trl/grpo_entropy.py`);
- an MoE router auxiliary loss (`router_aux_loss_coef != 0` on a model with `output_router_logits`): a statistic of
  the micro-batch's routing;
- `auto_find_batch_size=True`: an out-of-memory redo of the window would generate again;
- `verify_accumulation` other than `"off"`: the split-invariance probe needs model-ready micro-batches, and these
  trainers hand over prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...config.arguments import gradaccum_option
from ...losses.composed_class import nearest_trainer_named
from ...losses.composition_error import CompositionError

SEQUENCES = "sequences"
COMPLETION_TOKENS = "completion tokens"


@dataclass(frozen=True)
class LossItems:
    """What one loss type's mean over a micro-batch divides by.

    Args:
        items (`str`): `"sequences"` or `"completion tokens"`.
        rescales_num_items (`bool`): the loss divides by `inputs["num_items_in_batch"]` (tokens of the generation
            batch), which has to be presented as the micro-batch's own token count.
        per_generation_step (`bool`): that divisor is rescaled by TRL per step of the generation batch
            (`/ num_processes * current_gradient_accumulation_steps / steps_per_generation`, GRPO); `False`: only
            `/ num_processes` (the distillation trainer).
    """

    items: str
    rescales_num_items: bool = False
    per_generation_step: bool = True


# (trainer class name, loss_type) -> what that loss averages over. `None` as loss type: the trainer has one loss.
LOSS_ITEMS: dict[tuple[str, str | None], LossItems] = {
    ("GRPOTrainer", "grpo"): LossItems(SEQUENCES),
    ("GRPOTrainer", "sapo"): LossItems(SEQUENCES),
    ("GRPOTrainer", "dr_grpo"): LossItems(SEQUENCES),
    ("GRPOTrainer", "luspo"): LossItems(SEQUENCES),
    ("GRPOTrainer", "bnpo"): LossItems(COMPLETION_TOKENS),
    ("GRPOTrainer", "dapo"): LossItems(COMPLETION_TOKENS, rescales_num_items=True),
    ("GRPOTrainer", "cispo"): LossItems(COMPLETION_TOKENS, rescales_num_items=True),
    ("GRPOTrainer", "vespo"): LossItems(COMPLETION_TOKENS, rescales_num_items=True),
    ("RLOOTrainer", None): LossItems(SEQUENCES),
    # GMPO replaces GRPO's loss (whatever `loss_type` says) by a plain mean over sequences of each sequence's
    # geometric-mean term.
    ("GMPOTrainer", None): LossItems(SEQUENCES),
    # Token sum over the generated completions / `inputs["num_items_in_batch"] / num_processes`, the whole
    # generation batch's tokens (one generation per window).
    ("DistillationTrainer", None): LossItems(COMPLETION_TOKENS, rescales_num_items=True, per_generation_step=False),
    # SDFT (local teacher): mean over sequences of each sequence's token mean of the self-distillation divergence,
    # divided by `current_gradient_accumulation_steps`.
    ("SDFTTrainer", None): LossItems(SEQUENCES),
}

GENERATION_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "GMPOTrainer", "DistillationTrainer", "SDFTTrainer")


class GenerationBatchAccumulation:
    """
    Item weighting for one composed GRPO/RLOO trainer: which buffered micro-batch the loss sees, how many items its
    loss averages over, and how it is presented to TRL's loss. Built by [`generation_accumulation_for`].

    Args:
        trainer_name (`str`): `"GRPOTrainer"` or `"RLOOTrainer"`.
        loss_type (`str` or `None`): the trainer's `loss_type` (`None` for RLOO).
        loss_items ([`LossItems`]): what that loss averages over.
    """

    def __init__(self, trainer_name: str, loss_type: str | None, loss_items: LossItems) -> None:
        self.trainer_name = trainer_name
        self.loss_type = loss_type
        self.loss_items = loss_items

    def __repr__(self) -> str:
        return f"GenerationBatchAccumulation({self.trainer_name}, loss_type={self.loss_type!r}, items={self.items!r})"

    @property
    def items(self) -> str:
        return self.loss_items.items

    def count(self, micro_batch: dict[str, Any]) -> int:
        """Items of `micro_batch` that its loss averages over (see the module table)."""
        if self.items == SEQUENCES:
            return int(micro_batch["completion_ids"].shape[0])
        mask = micro_batch["completion_mask"]
        if "tool_mask" in micro_batch:
            mask = mask * micro_batch["tool_mask"]
        return int(mask.sum().item())

    def present(self, trainer: Any, micro_batch: dict[str, Any]) -> tuple[float, Callable[[], None]]:
        """
        Count the items of `micro_batch`, the inputs the loss is about to compute on (after TRL's `_prepare_inputs`
        generated and buffered it), and present it to TRL's loss as a batch of its own:
        `current_gradient_accumulation_steps` is 1 (TRL's losses scale themselves for accumulation by dividing by it;
        the accumulator does the weighting), and for losses that divide by the generation batch's
        `num_items_in_batch`, that count is presented as the module docstring says. Returns the count and a function
        that puts both back as TRL left them (the micro-batch is reused when `num_iterations > 1`).
        """
        saved = getattr(trainer, "current_gradient_accumulation_steps", None)
        trainer.current_gradient_accumulation_steps = 1
        items, restore_items = self._present_items(trainer, micro_batch)

        def restore() -> None:
            restore_items()
            if saved is None:
                del trainer.current_gradient_accumulation_steps
            else:
                trainer.current_gradient_accumulation_steps = saved

        return items, restore

    def _present_items(self, trainer: Any, micro_batch: dict[str, Any]) -> tuple[float, Callable[[], None]]:
        if not isinstance(micro_batch, dict) or "completion_ids" not in micro_batch:
            raise RuntimeError(
                f"GradAccumTrainer expected {self.trainer_name}'s loss to receive a buffered micro-batch of "
                f"completions, got {type(micro_batch).__name__}; this TRL release changed how it buffers "
                "generations, and composition with it is not supported (tested with trl==1.16)."
            )
        if not self.loss_items.rescales_num_items:
            return self.count(micro_batch), lambda: None
        original = micro_batch["num_items_in_batch"]
        n = self.count(micro_batch)
        if not self.loss_items.per_generation_step:
            # TRL divides by num_items_in_batch / num_processes: presented so that the divisor is exactly n.
            micro_batch["num_items_in_batch"] = torch.as_tensor(
                float(n * trainer.accelerator.num_processes), device=original.device
            )

            def put_back() -> None:
                micro_batch["num_items_in_batch"] = original

            return n, put_back
        steps_per_generation = trainer.args.steps_per_generation
        if steps_per_generation != trainer.args.gradient_accumulation_steps:
            # TRL's own large batch divides every step of a generation batch by the same count, the generation
            # batch's tokens per step and rank (with `current_gradient_accumulation_steps` presented as 1, that is
            # TRL's divisor as it stands): the micro-batch's loss is a mean over that many.
            per_step = float(original.clamp(min=1.0)) / (trainer.accelerator.num_processes * steps_per_generation)
            return per_step, lambda: None
        # TRL divides by num_items_in_batch / num_processes * current_gradient_accumulation_steps (presented as 1)
        # / steps_per_generation; every factor is an integer, so the divisor is exactly n.
        scale = trainer.accelerator.num_processes * trainer.args.steps_per_generation
        micro_batch["num_items_in_batch"] = torch.as_tensor(float(n * scale), device=original.device)

        def restore() -> None:
            micro_batch["num_items_in_batch"] = original

        return n, restore


def _generation_trainer_name(trainer: Any) -> str | None:
    # The nearest library class only: a subclass with a loss of its own is not its base's loss.
    return nearest_trainer_named(trainer, GENERATION_TRAINERS)


def _refuse(trainer_name: str, loss_type: str | None, why: str, fix: str) -> CompositionError:
    loss = f" with `loss_type={loss_type!r}`" if loss_type else ""
    return CompositionError(
        f"GradAccumTrainer cannot make {trainer_name}{loss} exact under gradient accumulation: {why}. {fix}"
    )


def generation_accumulation_for(trainer: Any) -> GenerationBatchAccumulation | None:
    """
    The [`GenerationBatchAccumulation`] of a trainer composed with TRL's `GRPOTrainer` or `RLOOTrainer`; `None` for
    any other trainer. Raises a `ValueError` naming the trainer, the loss type and the fix for a configuration whose
    loss no weighting of micro-batches can reproduce on the large batch (see the module docstring).
    """
    name = _generation_trainer_name(trainer)
    if name is None:
        return None
    args = trainer.args
    loss_type = getattr(args, "loss_type", None) if name == "GRPOTrainer" else None
    loss_items = LOSS_ITEMS.get((name, loss_type))
    if loss_items is None:
        raise _refuse(
            name,
            loss_type,
            "this loss type is not in GradAccumTrainer's table of what each loss averages over",
            "Use one of " + ", ".join(repr(t) for (n, t) in LOSS_ITEMS if n == name) + ".",
        )
    if args.auto_find_batch_size:
        raise _refuse(
            name,
            loss_type,
            "`auto_find_batch_size=True` redoes a window after an out-of-memory error, which would generate new "
            "completions mid-window",
            "Set `auto_find_batch_size=False` and choose `per_device_train_batch_size` yourself.",
        )
    if gradaccum_option(args, "verify_accumulation") != "off":
        raise _refuse(
            name,
            loss_type,
            "the split-invariance check needs model-ready micro-batches and this trainer hands over prompts",
            "Set `verify_accumulation='off'`; this loss type's weighting is known exact (hf_gradaccum/integrations/trl/grpo.py).",
        )
    if args.gradient_accumulation_steps == 1:
        return GenerationBatchAccumulation(name, loss_type, loss_items)
    if getattr(trainer, "use_teacher_server", False):
        raise _refuse(
            name,
            loss_type,
            "with `use_teacher_server=True` its loss is computed from a teacher server's log-probabilities, a "
            "different loss than the one GradAccumTrainer's table describes",
            "Use a local teacher (`use_teacher_server=False`), or `gradient_accumulation_steps=1` with the batch you "
            "want.",
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise _refuse(
            name,
            loss_type,
            "the MoE router auxiliary loss is a statistic of each micro-batch's routing, not a mean over its items",
            "Set `router_aux_loss_coef=0`, or `gradient_accumulation_steps=1` with the batch you want.",
        )
    if getattr(args, "use_adaptive_entropy", False) and loss_items.items != COMPLETION_TOKENS:
        # A static `entropy_coef` is weighted per term (`integrations/trl/loss_terms.py`); the adaptive controller
        # changes the coefficient inside the loss, where that weight is applied.
        raise _refuse(
            name,
            loss_type,
            "the adaptive entropy bonus is a mean over completion tokens while this loss is a mean over sequences, "
            "so the bonus needs a weight of its own per micro-batch, and the adaptive controller rewrites the "
            "coefficient that carries it inside the loss",
            "Use a token-mean loss type ('bnpo', 'dapo', 'cispo', 'vespo') with the adaptive bonus, or a static "
            "`entropy_coef` (`use_adaptive_entropy=False`).",
        )
    if (
        getattr(args, "entropy_coef", 0.0) != 0.0
        and loss_items.items != COMPLETION_TOKENS
        and args.steps_per_generation != args.gradient_accumulation_steps
    ):
        raise _refuse(
            name,
            loss_type,
            "the entropy bonus is weighted by the window's completion tokens, read from the generation batch, and "
            "with `steps_per_generation != gradient_accumulation_steps` the generation batch is not the window",
            "Set `steps_per_generation` equal to `gradient_accumulation_steps`, or `entropy_coef=0`.",
        )
    if (
        getattr(trainer, "_entropy_bonus_enabled", False)
        and loss_items.rescales_num_items
        and loss_items.per_generation_step
        and args.steps_per_generation != args.gradient_accumulation_steps
    ):
        raise _refuse(
            name,
            loss_type,
            "with `steps_per_generation != gradient_accumulation_steps` this loss divides by the generation batch's "
            "tokens per step while the entropy bonus divides by the micro-batch's own tokens, so the two terms need "
            "different micro-batch weights",
            "Set `steps_per_generation` equal to `gradient_accumulation_steps`, use `loss_type='bnpo'`, or set "
            "`entropy_coef=0` and `use_adaptive_entropy=False`.",
        )
    return GenerationBatchAccumulation(name, loss_type, loss_items)
