"""Ready-made coupled (in-batch-negative) losses for transformers models, and the Trainer that runs them exactly.

- [`clip_coupled_loss`]: transformers' `CLIPModel` with `return_loss=True` semantics (symmetric InfoNCE over the
  whole window, learnable `logit_scale` included).
- [`ranking_coupled_loss`]: a sentence-embedding multiple-negatives ranking loss on a BERT-family encoder (mean
  pooling, cosine similarity times `scale`, symmetric or not), as sentence-transformers'
  `MultipleNegativesRankingLoss` / `MultipleNegativesSymmetricRankingLoss`.
- Any other loss: [`~hf_gradaccum.engine.window_losses.coupled.CoupledLoss`] with your own `embed_fn` and `loss_fn`.
- [`CoupledWindowMode`]: what `GradAccumTrainer(coupled_loss=...)` runs: pass 1 over the window the Trainer
  prefetches (`get_batch_samples`), pass 2 per micro-batch in `compute_loss`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.window_losses.coupled import CoupledLoss, CoupledWindow, rows_in
from .model_inspection import unwrap_model

__all__ = [
    "CoupledWindowMode",
    "clip_coupled_loss",
    "clip_window_loss",
    "mean_pool",
    "ranking_coupled_loss",
    "ranking_window_loss",
]


# ---------------------------------------------------------------------------------------------------- CLIP
CLIP_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values")


def clip_window_loss(text_embeds: torch.Tensor, image_embeds: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """`CLIPModel(..., return_loss=True).loss` from normalised embeddings: symmetric cross-entropy over
    `text @ image.T * exp(logit_scale)`, each text's own image as its target (and each image's own text)."""
    logits_per_text = text_embeds @ image_embeds.t() * logit_scale.exp()
    targets = torch.arange(len(logits_per_text), device=logits_per_text.device)
    return (F.cross_entropy(logits_per_text, targets) + F.cross_entropy(logits_per_text.t(), targets)) / 2.0


def clip_coupled_loss(model: nn.Module | None = None, **kwargs: Any) -> CoupledLoss:
    """
    The coupled loss of a transformers `CLIPModel` (or any model whose forward returns normalised `text_embeds`
    and `image_embeds` and that has a `logit_scale` parameter): the window's `return_loss=True` loss. `model`, if
    given, is only checked for a `logit_scale`; the loss uses the model that runs the window.
    Micro-batches are dicts with `input_ids`, `attention_mask` (optional) and `pixel_values`; row `i` of the text is
    the caption of row `i` of the images. `kwargs` go to [`CoupledLoss`].

    Example:

    ```python
    >>> from transformers import CLIPConfig, CLIPModel
    >>> from hf_gradaccum.losses.coupled import clip_coupled_loss
    >>> model = CLIPModel(CLIPConfig(text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    ...     "num_attention_heads": 2}, vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    ...     "num_attention_heads": 2, "image_size": 8, "patch_size": 4}, projection_dim=8))
    >>> coupled = clip_coupled_loss(model)  # then coupled.accumulate_window(accumulator, model, micro_batches)
    ```
    """
    if model is not None and not isinstance(getattr(unwrap_model(model), "logit_scale", None), torch.Tensor):
        raise ValueError(
            f"`model` ({type(unwrap_model(model)).__name__}) has no `logit_scale`: is it a transformers `CLIPModel`?"
        )

    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out = model(**{k: batch[k] for k in CLIP_INPUTS if k in batch}, return_loss=False)
        return {"text": out.text_embeds, "image": out.image_embeds}

    def loss(reps: Mapping[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
        return clip_window_loss(reps["text"], reps["image"], unwrap_model(model).logit_scale)

    return CoupledLoss(embed, loss, **kwargs)


# ---------------------------------------------------------------------------------------------------- ranking
def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors over the non-padding positions (sentence-transformers' mean pooling)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def ranking_window_loss(
    anchors: torch.Tensor, positives: torch.Tensor, scale: float = 20.0, symmetric: bool = False
) -> torch.Tensor:
    """Multiple-negatives ranking loss: cross-entropy over `scale * cos(anchor_i, positive_j)`, target `j = i`
    (every other positive of the batch is a negative); `symmetric` averages it with the positive-to-anchor one."""
    scores = F.normalize(anchors, dim=-1) @ F.normalize(positives, dim=-1).t() * scale
    targets = torch.arange(len(scores), device=scores.device)
    forward = F.cross_entropy(scores, targets)
    return (forward + F.cross_entropy(scores.t(), targets)) / 2.0 if symmetric else forward


def ranking_coupled_loss(
    scale: float = 20.0,
    symmetric: bool = False,
    anchor_prefix: str = "anchor_",
    positive_prefix: str = "positive_",
    **kwargs: Any,
) -> CoupledLoss:
    """
    Multiple-negatives ranking loss on a BERT-family encoder (any model whose output has `last_hidden_state`), mean
    pooled. Micro-batches are dicts with `anchor_input_ids`, `anchor_attention_mask`, `positive_input_ids`,
    `positive_attention_mask` (and optionally `*_token_type_ids`); the prefixes are configurable. `kwargs` go to
    [`CoupledLoss`].

    Example:

    ```python
    >>> from hf_gradaccum.losses.coupled import ranking_coupled_loss
    >>> coupled = ranking_coupled_loss(scale=20.0, symmetric=True)
    ```
    """
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"`scale` must be a number > 0, got {scale!r}.")
    if not isinstance(symmetric, bool):
        raise ValueError(f"`symmetric` must be True or False, got {symmetric!r}.")

    def encode(model: nn.Module, batch: Mapping[str, Any], prefix: str) -> torch.Tensor:
        inputs = {k[len(prefix) :]: v for k, v in batch.items() if k.startswith(prefix)}
        if "input_ids" not in inputs:
            raise ValueError(f"A ranking micro-batch needs `{prefix}input_ids`; it has {sorted(batch)}.")
        if "attention_mask" not in inputs:
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        return mean_pool(model(**inputs).last_hidden_state, inputs["attention_mask"])

    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {"anchor": encode(model, batch, anchor_prefix), "positive": encode(model, batch, positive_prefix)}

    def loss(reps: Mapping[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
        return ranking_window_loss(reps["anchor"], reps["positive"], scale, symmetric)

    kwargs.setdefault("num_items_fn", lambda batch: rows_in(batch[anchor_prefix + "input_ids"]))
    return CoupledLoss(embed, loss, **kwargs)


# ---------------------------------------------------------------------------------------------------- Trainer mode
class CoupledWindowMode:
    """
    The coupled-loss mode of [`GradAccumTrainer`] (its `coupled_loss=` argument): a loss over the whole window
    (in-batch negatives), exact to the large batch of `per_device_train_batch_size * gradient_accumulation_steps *
    world_size` samples. The Trainer calls it from its public hooks:

    - `get_batch_samples` -> [`window_prefetched`]: keep the window the Trainer prefetches (pass 1 needs all of it
      before any backward);
    - `training_step` -> [`training_step`]: before the window's first micro-batch, pass 1 and the window loss; after
      its last, the RNG left where one pass over the window would have left it;
    - `compute_loss` -> [`compute_loss`]: the micro-batch's pass-2 surrogate, which the accumulator weights as any
      loss; outside training (evaluation) the coupled loss of the batch alone (when `owns_loss`);
    - `count_micro_batch_items`: the coupled loss's items (rows by default).

    Args:
        coupled_loss ([`~hf_gradaccum.engine.window_losses.coupled.CoupledLoss`]): the window loss.
        owns_loss (`bool`, *optional*, defaults to `True`): whether the loss outside pass 2 (evaluation) is the
            coupled loss too; `False` when the composed trainer has a loss of its own (sentence-transformers).
    """

    def __init__(self, coupled_loss: CoupledLoss, *, owns_loss: bool = True) -> None:
        if not isinstance(coupled_loss, CoupledLoss):
            raise ValueError(
                f"`coupled_loss` must be a hf_gradaccum CoupledLoss (e.g. `ranking_coupled_loss()`), got "
                f"{type(coupled_loss).__name__}."
            )
        self.coupled_loss = coupled_loss
        self.owns_loss = owns_loss
        self.batches: list[Any] = []
        self._index = 0
        self._window: CoupledWindow | None = None
        self._current: int | None = None

    @property
    def in_pass_two(self) -> bool:
        """Whether a micro-batch of a prepared window is running (its loss is the pass-2 surrogate)."""
        return self._current is not None and self._window is not None

    def window_prefetched(self, batches: list[Any]) -> None:
        self.batches, self._index, self._window = list(batches), 0, None

    def training_step(self, trainer: Any, model: nn.Module, inputs: Any, step: Any) -> torch.Tensor:
        """Run `step()` (the accumulating micro-step) for `inputs`, with pass 1 before the window's first."""
        batches, index = self.batches, self._index
        if index >= len(batches):
            # Called outside `train()`'s window loop (e.g. directly): the micro-batch is a window of its own.
            batches, index = [inputs], 0
            self.batches, self._window = batches, None
        if index == 0:
            model.train()
            with torch.no_grad(), trainer.compute_loss_context_manager():
                prepared = [trainer._prepare_inputs(b) for b in batches]
            with trainer.compute_loss_context_manager():
                self._window = self.coupled_loss.prepare_window(model, prepared)
        self._current = index
        try:
            loss = step()
        finally:
            self._current = None
        self._index = index + 1
        if self._index == len(batches):
            self.coupled_loss.finish_passes(self._window)
            self.coupled_loss.last_window = self._window
            self._window = None
        return loss

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False) -> Any:
        if self.in_pass_two:
            loss = self.coupled_loss.micro_batch_loss(self._window, model, self._current, inputs)
        else:
            loss = self.coupled_loss.window_loss(model, [inputs])
        return (loss, {"loss": loss}) if return_outputs else loss

    def verify(self, trainer: Any, batches: list[Any]):
        """The `verify_accumulation` check in the coupled mode: [`verify_coupled_split_invariance`] on the window
        (the ordinary check would compare per-micro-batch losses, which a window-coupled loss is not, and report an
        exact coupled run as not exact). Returns its result (`None` if the window could not be checked)."""
        from .accumulation_check import check_trainer_window

        def probe(model: nn.Module, prepared: list[Any]):
            with trainer.compute_loss_context_manager():
                return verify_coupled_split_invariance(model, prepared, self.coupled_loss)

        return check_trainer_window(trainer, batches, probe=probe)


# ---------------------------------------------------------------------------------------------------- exactness check
def coupled_gradient(
    model: nn.Module, coupled: CoupledLoss, micro_batches: list[Any], params: list[nn.Parameter]
) -> list[torch.Tensor]:
    """The coupled mode's window gradient for this split of the window, in fp32, without touching `.grad`: pass 1,
    the window loss, and each micro-batch's pass-2 surrogate weighted `n_k / N` as the accumulator weights it."""
    window = coupled.prepare_window(model, micro_batches, params)
    grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for index, batch in enumerate(micro_batches):
        surrogate = coupled.micro_batch_loss(window, model, index, batch)
        parts = torch.autograd.grad(surrogate, params, allow_unused=True)
        weight = window.num_items[index] / window.total_items
        for acc, g in zip(grads, parts, strict=True):
            if g is not None:
                acc.add_(g.float(), alpha=weight)
    coupled.finish_passes(window)
    return grads


def verify_coupled_split_invariance(
    model: nn.Module,
    batches: list[dict[str, Any]],
    coupled: CoupledLoss,
    *,
    splits: tuple[str, ...] = ("half", "full"),
    rtol: float | None = None,
):
    """
    The split-invariance check of [`~hf_gradaccum.verify_split_invariance`] for the coupled-loss mode: the window's
    gradient in the coupled mode for the micro-batches as given, for each micro-batch halved (`"half"`) and for one
    batch (`"full"`), under the same isolation (dropout neutralised, RNG and buffers restored). Returns a
    `SplitInvarianceResult` (`passed` means: the coupled mode is exact for this model and loss).

    Example:

    ```python
    >>> from hf_gradaccum.losses.coupled import verify_coupled_split_invariance  # doctest: +SKIP
    >>> verify_coupled_split_invariance(model, window, clip_coupled_loss()).passed  # doctest: +SKIP
    True
    ```
    """
    import time

    from ..verification.isolation import isolated_probe
    from ..verification.split_invariance import SplitInvarianceResult, tolerance_for
    from ..verification.windows import concat_window, cut

    bad = sorted(set(splits) - {"half", "full"})
    if bad or not splits:
        raise ValueError(f"`splits` must be a non-empty subset of ('half', 'full'), got {splits!r}.")
    start = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    rows, sizes = concat_window(batches)
    plan = {"window": sizes}
    if "half" in splits:
        plan["half"] = [part for n in sizes for part in ((n - n // 2, n // 2) if n >= 2 else (n,))]
    if "full" in splits:
        plan["full"] = [sum(sizes)]
    lowest = min({p.dtype for p in params}, key=lambda d: -torch.finfo(d).eps)
    tolerance = float(rtol) if rtol is not None else tolerance_for(lowest)
    rel_diffs = {}
    with isolated_probe(model):
        reference = coupled_gradient(model, coupled, cut(rows, sizes), params)
        ref_norm = sum(float(g.pow(2).sum()) for g in reference) ** 0.5
        for name, split in plan.items():
            if name == "window":
                continue
            grads = coupled_gradient(model, coupled, cut(rows, split), params)
            diff = sum(float((g - r).pow(2).sum()) for g, r in zip(grads, reference, strict=True)) ** 0.5
            rel_diffs[name] = diff / ref_norm
    max_rel = max(rel_diffs.values())
    return SplitInvarianceResult(
        passed=max_rel <= tolerance,
        max_rel_diff=max_rel,
        rel_diffs=rel_diffs,
        tolerance=tolerance,
        tolerance_rule="given" if rtol is not None else f"{str(lowest).replace('torch.', '')} computation",
        splits=plan,
        seconds=time.perf_counter() - start,
        notes=["coupled-loss mode (gradient caching): the loss spans the whole window"],
    )
