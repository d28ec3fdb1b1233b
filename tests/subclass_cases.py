"""The subclass zoo: `Trainer` subclasses that override `training_step` (and `create_optimizer`, `_get_train_sampler`,
`get_train_dataloader`, `compute_loss`, a callback) as people write them in existing Hugging Face training code, each
trained for one optimizer step on the same window of `ROWS` rows three ways, each from the same initial weights (CPU
fp32, SGD, constant learning rate, no clipping unless the case is about clipping, no weight decay, dataset order
unless the case sets its own sampler, every dropout 0):

- `reference`: the stock `transformers.Trainer` on the window as one batch (`ROWS` x 1);
- `stock`: the stock `Trainer` at `MICRO` x `STEPS` (what plain accumulation gives);
- `ours`: `GradAccumTrainer` with `GradAccumArguments` and default accumulation options, at `MICRO` x `STEPS`.

Each case is one mixin class written once (`class T(Mixin, Trainer)`, `class T(Mixin, GradAccumTrainer)`), on a tiny
random-init BERT sequence classifier (eager attention) whose default loss is the mean cross-entropy over rows. What the
large batch means for each override (the reference) is `Case.large_batch`; where no accumulation can reproduce it in
one pass over the window (FGM and SAM perturb along the whole batch's gradient), it says so.

The machinery (rows, collator, model, the single run, verdicts) is `tests/users_losses_cases.py`'s;
`benchmarks/subclass_zoo.py` runs every (case, trainer) in its own process, classifies each run against the reference
and writes the table. `train_once` here is the single run: `tests/users_losses_cases.py`'s, recording in addition which
rows the loader fetched and whether ours' accumulator ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, SequentialSampler, WeightedRandomSampler
from transformers import TrainerCallback

import tests.users_losses_cases as users_losses
from tests.users_losses_cases import (  # noqa: F401  (re-exported for the runner)
    MICRO,
    ROWS,
    RTOL,
    STEPS,
    VERDICTS,
    Outcome,
    bert_seq,
    classify,
    first_line,
    noise_rows,
    quietly,
    relative,
    seq_rows,
)

# ---------------------------------------------------------------------------------------------------------------------
# Data: the rows, and which of them the loader fetched (to check that every run saw the same rows in the same order)


class RecordedRows(Dataset):
    """The window's rows; `fetched` lists every index the loaders asked for, in order."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.fetched.append(int(i))
        return self.rows[i]


# ---------------------------------------------------------------------------------------------------------------------
# Notes a case records on its trainer (shown in the table where `Case.show` names them)


def _note(trainer: Any, key: str, value: Any) -> None:
    trainer.__dict__.setdefault("case_notes", {}).setdefault(key, []).append(value)


def _count(trainer: Any, key: str) -> None:
    notes = trainer.__dict__.setdefault("case_notes", {})
    notes[key] = notes.get(key, 0) + 1


def _total_grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.detach().double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# The overrides. Each is written once, as in user code: `super()` resolves to `Trainer` or to `GradAccumTrainer`.


class LogsLossAfterSuper:
    """`training_step` calls `super()` and logs the loss it returns (`self.log` and a list)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        _note(self, "step_loss", round(float(loss), 5))
        self.log({"micro_loss": loss.item()})
        return loss


LLRD_DECAY = 0.5


class LayerwiseLRDecay:
    """Layer-wise learning-rate decay: `create_optimizer` builds one SGD parameter group per depth (embeddings
    deepest decayed, the classifier at the full rate)."""

    def create_optimizer(self, model=None):
        model = model if model is not None else self.model
        if self.optimizer is None:
            layers = model.config.num_hidden_layers
            groups: dict[int, list[torch.nn.Parameter]] = {}
            for name, param in model.named_parameters():
                if not param.requires_grad:
                    continue
                if "embeddings" in name:
                    depth = 0
                elif "encoder.layer." in name:
                    depth = int(name.split("encoder.layer.")[1].split(".")[0]) + 1
                else:
                    depth = layers + 1
                groups.setdefault(depth, []).append(param)
            self.optimizer = torch.optim.SGD(
                [
                    {"params": params, "lr": self.args.learning_rate * LLRD_DECAY ** (layers + 1 - depth)}
                    for depth, params in sorted(groups.items())
                ],
                lr=self.args.learning_rate,
            )
        return self.optimizer


SAMPLER_WEIGHTS = [1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 8.0, 1.0]
SAMPLER_SEED = 1234


class SeededWeightedSampler:
    """`_get_train_sampler` returns a `WeightedRandomSampler` (with replacement, the class-balancing default) over the
    rows, with a generator seeded in the method: every run draws the same 12 indices, repeats included."""

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        generator = torch.Generator().manual_seed(SAMPLER_SEED)
        return WeightedRandomSampler(SAMPLER_WEIGHTS, num_samples=len(dataset), replacement=True, generator=generator)


class OwnTrainDataloader:
    """Its own `get_train_dataloader`: a plain `DataLoader` (sequential, the Trainer's batch size and collator), not
    passed through `accelerator.prepare`."""

    def get_train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=SequentialSampler(
            self.train_dataset), collate_fn=self.data_collator, drop_last=False)  # fmt: skip


class CurriculumFactor:
    """`compute_loss` scales the model's loss by a curriculum factor of `self.state.global_step` (1.0 at step 0)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _note(self, "global_step", self.state.global_step)
        factor = 1.0 / (1.0 + 0.5 * self.state.global_step)
        outputs = model(**inputs)
        loss = factor * outputs.loss
        return (loss, outputs) if return_outputs else loss


class StockBodyCopy:
    """`training_step` with the stock body of transformers 5.24's `Trainer.training_step` copied verbatim (and some
    code of one's own that would go around it)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        from accelerate.utils import DistributedType
        from accelerate.utils.memory import clear_device_cache
        from transformers.training_args import OptimizerNames
        from transformers.utils import is_sagemaker_mp_enabled

        _count(self, "user_steps")
        # --- transformers 5.24 `Trainer.training_step`, verbatim from here
        # Prepare buffers for context parallelism

        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)

        # Context manager is no-op if CP isn't enabled
        with cp_context():
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()

            inputs = self._prepare_inputs(inputs)
            if is_sagemaker_mp_enabled():
                from transformers.trainer_pt_utils import smp_forward_backward

                loss_mb = smp_forward_backward(model, inputs, self.args.gradient_accumulation_steps)
                return loss_mb.reduce_mean().detach().to(self.args.device)

            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

            del inputs
            if (
                self.args.torch_empty_cache_steps is not None
                and self.state.global_step % self.args.torch_empty_cache_steps == 0
            ):
                clear_device_cache()
                if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
                    torch.mps.clear_graph_cache()

            kwargs = {}

            # For LOMO optimizers you need to explicitly use the learning rate
            if self.args.optim in [OptimizerNames.LOMO, OptimizerNames.ADALOMO]:
                kwargs["learning_rate"] = self._get_learning_rate()

            if self.args.n_gpu > 1:
                loss = loss.mean()  # mean() to average on multi-gpu parallel training

            # Finally we need to normalize the loss for reporting if GA loss bug is not fixed during compute loss
            if self.loss_is_scaled_for_ga is not None:
                loss_is_scaled_for_ga = self.loss_is_scaled_for_ga
            else:
                # The loss is scaled when it was normalized by `num_items_in_batch`, by the model or by `compute_loss_func`
                loss_is_scaled_for_ga = (
                    self.model_accepts_loss_kwargs and num_items_in_batch is not None
                ) or self.compute_loss_func is not None
            if not loss_is_scaled_for_ga:
                loss = loss / self.current_gradient_accumulation_steps

            # Turning off loss scaling w.r.t. gradient accumulation when DeepSpeed is enabled
            # https://github.com/huggingface/transformers/pull/35808
            if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                kwargs["scale_wrt_gas"] = False

            self.accelerator.backward(loss, **kwargs)

            return loss.detach()


class OlderShape:
    """The shorter `training_step` many codebases carry (4.2x-era): divide by `gradient_accumulation_steps` by hand,
    `self.accelerator.backward(loss)`."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        _count(self, "user_steps")
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()


class OldestShapeLossBackward:
    """The same with `loss.backward()` (before the Trainer used Accelerate)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        _count(self, "user_steps")
        model.train()
        inputs = self._prepare_inputs(inputs)
        loss = self.compute_loss(model, inputs)
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        loss.backward()
        return loss.detach()


class SuperWithoutNumItems:
    """`training_step(self, model, inputs, num_items_in_batch=None)` that calls `super().training_step(model, inputs)`
    (a 4.45-era signature patched to accept the new argument, which is then not passed on)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs)


FGM_EPSILON = 1.0


class FGM:
    """The FGM helper as it circulates (competition notebooks, blog posts): move the parameters whose name contains
    `emb_name` by epsilon along their normalised gradient, and put them back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.backup: dict[str, torch.Tensor] = {}

    def attack(self, epsilon: float = FGM_EPSILON, emb_name: str = "word_embeddings") -> None:
        for name, param in self.model.named_parameters():
            if param.requires_grad and emb_name in name:
                self.backup[name] = param.data.clone()
                norm = torch.norm(param.grad)
                if norm != 0 and not torch.isnan(norm):
                    r_at = epsilon * param.grad / norm
                    param.data.add_(r_at)

    def restore(self, emb_name: str = "word_embeddings") -> None:
        for name, param in self.model.named_parameters():
            if param.requires_grad and emb_name in name:
                assert name in self.backup
                param.data = self.backup[name]
        self.backup = {}


class FGMAdversarial:
    """FGM in `training_step`: the clean backward through `super()`, `fgm.attack()` (the word embeddings moved along
    their gradient), the adversarial loss's forward and backward (`compute_loss` + `accelerator.backward`, divided by
    the accumulation steps by hand), `fgm.restore()`."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        fgm = FGM(model)
        fgm.attack()
        with self.compute_loss_context_manager():
            loss_adv = self.compute_loss(model, self._prepare_inputs(inputs))
        if self.args.gradient_accumulation_steps > 1:
            loss_adv = loss_adv / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss_adv)
        fgm.restore()
        return loss


class SuperTwiceTokenDrop:
    """`super().training_step` twice: the batch, and a copy with every third token (after [CLS]) masked out of the
    attention; returns the sum."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        dropped = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        dropped["attention_mask"][:, 1::3] = 0
        loss = super().training_step(model, inputs, num_items_in_batch)
        return loss + super().training_step(model, dropped, num_items_in_batch)


# Chosen from the large batch's gradient (the 99th percentile of |g| is about 0.0067): about 1.5% of its entries are
# above it (the reference records the share).
CLIP_VALUE = 0.005


class ClipGradValueAfterSuper:
    """`torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)` after `super().training_step(...)`."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        above = sum(int((g.abs() > CLIP_VALUE).sum()) for g in grads)
        _note(self, "share_clipped", round(above / max(1, sum(g.numel() for g in grads)), 4))
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        return loss


class GradNormLogging:
    """After `super()`, the gradient norm of every parameter is read and stored (a dict per micro-step)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        norms = {name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None}
        self.__dict__.setdefault("grad_norm_history", []).append(norms)
        _note(self, "grad_norm", round(_total_grad_norm(model), 5))
        return loss


class BackwardInComputeLoss:
    """`compute_loss` back-propagates the plain mean itself (`self.accelerator.backward`, divided by the accumulation
    steps) and returns `loss.detach()`; `training_step` is overridden not to back-propagate again."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _count(self, "compute_loss_calls")
        outputs = model(**inputs)
        loss = outputs.loss
        if model.training and torch.is_grad_enabled():
            _count(self, "backwards_in_compute_loss")
            self.accelerator.backward(loss / self.args.gradient_accumulation_steps)
        return (loss.detach(), outputs) if return_outputs else loss.detach()

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss / self.args.gradient_accumulation_steps


class ZeroEmbeddingGradAtSync:
    """After `super()`, on the window's last micro-batch (`self.accelerator.sync_gradients`), the word embeddings'
    gradient is zeroed (kept frozen without `requires_grad_(False)`)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            _count(self, "zeroed")
            model.bert.embeddings.word_embeddings.weight.grad.zero_()
        return loss


NEW_TOKENS_FROM = 40


class MaskOldVocabGradEveryStep:
    """After every `super()`, the gradient of the embedding rows of the "old" vocabulary (ids below
    `NEW_TOKENS_FROM`) is zeroed: only the new tokens' embeddings train (the add-tokens pattern), written for the
    stock Trainer, where the gradient exists after every backward."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        model.get_input_embeddings().weight.grad[:NEW_TOKENS_FROM] = 0
        return loss


class MaskOldVocabGradGuarded:
    """The same with an `if grad is not None` guard."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        grad = model.get_input_embeddings().weight.grad
        _note(self, "grad_present", grad is not None)
        if grad is not None:
            grad[:NEW_TOKENS_FROM] = 0
        return loss


SAM_RHO = 0.5


class SAMTwoStep:
    """SAM in `training_step`, aware of accumulation: the gradients accumulated so far set aside, this batch's gradient
    at w (`super()`), the weights moved to w + rho g/||g||, the gradient there (`super()` again), the weights back, and
    the set-aside gradients added back."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        params = [p for p in model.parameters() if p.requires_grad]
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        grads = [p.grad for p in params]
        norm = torch.norm(torch.stack([g.norm() for g in grads if g is not None]))
        scale = SAM_RHO / (norm + 1e-12)
        eps = []
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                e = None if g is None else g * scale
                if e is not None:
                    p.add_(e)
                eps.append(e)
        for p in params:
            p.grad = None
        super().training_step(model, inputs, num_items_in_batch)
        with torch.no_grad():
            for p, e, k in zip(params, eps, kept, strict=True):
                if e is not None:
                    p.sub_(e)
                if k is not None:
                    p.grad = k if p.grad is None else p.grad + k
        return loss


class OwnStepWithoutDivision:
    """Its own `training_step` that back-propagates `compute_loss`'s loss without dividing by the accumulation steps
    (a sum over the window's micro-batches under the stock Trainer)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        self.accelerator.backward(loss)
        return loss.detach()


class BackwardInsideComputeLossOnly:
    """`compute_loss` back-propagates the model's mean itself (`self.accelerator.backward(loss)`) and returns it
    detached; `training_step` is the Trainer's."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss
        if model.training and torch.is_grad_enabled():
            _count(self, "backwards_in_compute_loss")
            self.accelerator.backward(loss)
        return (loss.detach(), outputs) if return_outputs else loss.detach()


class BackwardInsideComputeLossDivided:
    """The same, divided by `self.args.gradient_accumulation_steps` before the backward (written for the stock
    Trainer's accumulation)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss
        if model.training and torch.is_grad_enabled():
            self.accelerator.backward(loss / self.args.gradient_accumulation_steps)
        return (loss.detach(), outputs) if return_outputs else loss.detach()


def ignored_label_rows(g: torch.Generator) -> list[dict]:
    """Sequence rows where some labels are -100 (left out of the loss's mean): 2, 3, 1 and 3 labelled rows in the four
    micro-batches, so the micro-batches' means are over different counts."""
    labels = [-100, 1, 0, 2, 1, 0, -100, -100, 2, 0, 1, 2]
    return seq_rows(g, labels=labels)


class _GradNormReader(TrainerCallback):
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        _note(self.trainer, "grad_norm", round(_total_grad_norm(self.trainer.model), 5))


class _GradValueClipper(TrainerCallback):
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        torch.nn.utils.clip_grad_value_(self.trainer.model.parameters(), CLIP_VALUE)


class CallbackReadsGrads:
    """A callback added in `__init__` reads the gradient norm in `on_pre_optimizer_step` (must not change the step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(_GradNormReader(self))


class CallbackClipsGradValue:
    """A callback added in `__init__` clips the gradients by value in `on_pre_optimizer_step`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(_GradValueClipper(self))


class PassThroughStep:
    """`training_step` that only calls `super()` (a placeholder override, here with the Trainer's norm clipping on)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


class RDropOwnStep:
    """R-drop in its own `training_step` (no `compute_loss`): two forwards (the second with a fixed per-row embedding
    perturbation standing in for dropout), CE of both + symmetric KL, divided by the accumulation steps by hand,
    `self.accelerator.backward`."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        _count(self, "user_steps")
        model.train()
        inputs = self._prepare_inputs(inputs)
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        logits1 = model(input_ids=ids, attention_mask=mask).logits
        embeds = model.get_input_embeddings()(ids) + 0.5 * inputs["noise"][:, : ids.shape[1]]
        logits2 = model(inputs_embeds=embeds, attention_mask=mask).logits
        lp1, lp2 = logits1.log_softmax(-1), logits2.log_softmax(-1)
        ce = 0.5 * (F.nll_loss(lp1, labels) + F.nll_loss(lp2, labels))
        kl = 0.5 * (F.kl_div(lp1, lp2, reduction="batchmean", log_target=True)
                    + F.kl_div(lp2, lp1, reduction="batchmean", log_target=True))  # fmt: skip
        loss = ce + kl
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()


# ---------------------------------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class Case:
    """One override pattern.

    Args:
        name: short, descriptive.
        mixin: the class with the override(s).
        large_batch: what the one batch of `ROWS` means for it (the reference), in words.
        rows: builds the window's rows from a seeded generator.
        args: `TrainingArguments` fields changed from `TRAIN_ARGS` (clipping).
        show: keys of the trainer's `case_notes` the table shows for every run.
        model, width, prepare: as `tests/users_losses_cases.py`'s `Case` (the same for every case here: the tiny
            BERT sequence classifier, each batch padded to its longest row, nothing to prepare).
        parent_order: the mixin is the user's existing `Trainer` subclass, composed after `GradAccumTrainer`
            (`class T(GradAccumTrainer, Base)`) instead of before it.
    """

    name: str
    mixin: type
    large_batch: str
    rows: Callable[[torch.Generator], list[dict]] = seq_rows
    args: dict[str, Any] = field(default_factory=dict)
    show: tuple[str, ...] = ()
    model: Callable[[], torch.nn.Module] = bert_seq
    width: int | None = None
    prepare: Callable[[Any], None] | None = None
    parent_order: bool = False


# The large batch's gradient norm is about 0.22 (these rows and weights): clipped to about a third.
MAX_GRAD_NORM = 0.07

CASES: tuple[Case, ...] = (
    Case("log_loss_after_super", LogsLossAfterSuper,
         "the plain step; the logged loss is the batch's mean", show=("step_loss",)),
    Case("llrd_create_optimizer", LayerwiseLRDecay,
         f"the batch's mean gradient, stepped with per-depth rates (decay {LLRD_DECAY})"),
    Case("weighted_random_sampler", SeededWeightedSampler,
         "the 12 indices the seeded sampler draws (repeats included), as one batch"),
    Case("own_train_dataloader", OwnTrainDataloader, "the plain step (the loader only batches)"),
    Case("curriculum_global_step", CurriculumFactor,
         "the mean x the factor at step 0 (1.0)", show=("global_step",)),
    Case("stock_body_copy", StockBodyCopy,
         "the plain step (the body is the stock one)", show=("user_steps",)),
    Case("older_shape_divide_by_ga", OlderShape,
         "the plain step (the hand division is by 1)", show=("user_steps",)),
    Case("oldest_shape_loss_backward", OldestShapeLossBackward,
         "the plain step, `loss.backward()` directly", show=("user_steps",)),
    Case("super_without_num_items", SuperWithoutNumItems, "the plain step"),
    Case("fgm_adversarial", FGMAdversarial,
         "clean grad of the 12 rows + adversarial grad at embeddings moved along the 12 rows' clean embedding gradient "
         "(needs the whole window's clean gradient before any adversarial pass: not one-pass accumulable)"),
    Case("super_twice_token_drop", SuperTwiceTokenDrop,
         "mean CE of the 12 rows + mean CE of the 12 rows with every third token masked (two backwards)"),
    Case("clip_grad_value_after_super", ClipGradValueAfterSuper,
         f"the batch's mean gradient, clipped by value ({CLIP_VALUE}) once", show=("share_clipped",)),
    Case("grad_norm_logging", GradNormLogging,
         "the plain step; the norm read is the mean gradient's", show=("grad_norm",)),
    Case("backward_in_compute_loss", BackwardInComputeLoss,
         "the plain step (the backward moved into `compute_loss`)",
         show=("compute_loss_calls", "backwards_in_compute_loss")),
    Case("zero_embedding_grad_at_sync", ZeroEmbeddingGradAtSync,
         "the batch's mean gradient with the word embeddings' zeroed (frozen)", show=("zeroed",)),
    Case("mask_old_vocab_grad", MaskOldVocabGradEveryStep,
         f"the batch's mean gradient with embedding rows < {NEW_TOKENS_FROM} zeroed"),
    Case("mask_old_vocab_grad_guarded", MaskOldVocabGradGuarded,
         f"the batch's mean gradient with embedding rows < {NEW_TOKENS_FROM} zeroed", show=("grad_present",)),
    Case("sam_two_step", SAMTwoStep,
         "SAM on the 12 rows: gradient at w + rho g/||g||, g the 12 rows' gradient (needs the whole window's "
         "gradient first: not one-pass accumulable)"),
    Case("callback_reads_grads", CallbackReadsGrads,
         "the plain step; the norm read is the mean gradient's", show=("grad_norm",)),
    Case("callback_clips_grad_value", CallbackClipsGradValue,
         f"the batch's mean gradient, clipped by value ({CLIP_VALUE}) once"),
    Case("passthrough_max_grad_norm", PassThroughStep,
         f"the batch's mean gradient, norm-clipped to {MAX_GRAD_NORM} by the Trainer",
         args={"max_grad_norm": MAX_GRAD_NORM}),
    Case("stock_body_copy_parent_order", StockBodyCopy,
         "the plain step (the stock body, in the user's `Trainer` subclass after GradAccumTrainer)",
         show=("user_steps",), parent_order=True),
    Case("older_shape_parent_order", OlderShape,
         "the plain step (the hand division, in the user's `Trainer` subclass after GradAccumTrainer)",
         show=("user_steps",), parent_order=True),
    Case("older_shape_ignored_rows", OlderShape,
         "the mean over the 9 labelled rows (micro-batches of 2, 3, 1 and 3: the hand division by 4 is not their "
         "share)", rows=ignored_label_rows, show=("user_steps",)),
    Case("own_step_without_division", OwnStepWithoutDivision,
         "the plain step (the override's backward is of the batch's mean; at 3 x 4 its sum over micro-batches is not "
         "the large batch's)"),
    Case("rdrop_own_step", RDropOwnStep,
         "mean CE of both views + symmetric KL over the 12 rows (no `compute_loss` call)", rows=noise_rows,
         show=("user_steps",)),
)  # fmt: skip


def find_case(name: str) -> Case:
    return users_losses.find_case(name, CASES)


# ---------------------------------------------------------------------------------------------------------------------
# One run


def _observe(out: dict[str, Any], trainer: Any, dataset: RecordedRows) -> None:
    """The rows the loader fetched and, for ours, whether `GradAccumTrainer.training_step` ran at all (an override that
    never calls `super()` bypasses it)."""
    out["fetched"] = dataset.fetched[:40]
    out["fetched_count"] = len(dataset.fetched)
    if out["kind"] == "ours" and trainer is not None:
        out["accumulator_ran"] = getattr(trainer, "accumulator", None) is not None


def train_once(case: Case, kind: str, output_dir: str) -> dict[str, Any]:
    """One optimizer step of the case with the run `kind` of `RUNS` (`tests/users_losses_cases.py`'s `train_once`):
    the update (or the exception), the optimizer steps taken, the rows the loader fetched, what the override recorded
    and, for ours, the package's own finding."""
    return users_losses.train_once(case, kind, output_dir, cases_file="tests/subclass_cases.py",
                                   dataset_type=RecordedRows, observe=_observe)  # fmt: skip


__all__ = ["CASES", "Case", "Outcome", "classify", "find_case", "first_line", "quietly", "relative", "train_once"]
