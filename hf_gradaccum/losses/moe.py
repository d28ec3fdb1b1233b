"""Exact window-level MoE load balancing for transformers models, in a plain loop or through `GradAccumTrainer`.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, OLMoE, ...) add `router_aux_loss_coef * aux` to their loss when
`output_router_logits=True`, where `aux` is a statistic of the batch (`engine/window_losses/moe_balance.py`). Accumulated per
micro-batch it is a different objective. With `moe_load_balance="window"`:

1. a forward-only pass over the window (no gradients, torch RNG state restored afterwards so that router jitter and
   dropout draw the same values again) counts the window's expert assignments and tokens (over all ranks);
2. each micro-batch then runs with the model's own auxiliary loss off (`output_router_logits=False`), its router
   logits captured by forward hooks on the router modules, and gets the exact term `a_k * N / n_k` added to its
   language-model mean loss; the accumulator's `n_k / N` weighting makes the window's update the large batch's.

Cost: one extra forward per micro-batch (measured in `docs/moe_balance.md`). The default, `"micro_batch"`, keeps
the model's own per-micro-batch term, which the accumulator weights by items (inexact, free).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..engine.items import count_items_in_batch
from ..engine.rng import capture_rng_state, restore_rng_state
from ..engine.window_losses.moe_balance import RouterCounts, exact_aux_term, router_counts
from .model_inspection import unwrap_model
from .model_losses import ModelLossError

__all__ = ["MoEWindowMode", "WindowRouterBalance", "adds_router_loss", "find_router_modules", "window_router_mode"]


def adds_router_loss(model: nn.Module) -> bool:
    """
    Whether `model`'s loss includes a router load-balancing term: a transformers MoE model whose config asks for
    router logits with a non-zero `router_aux_loss_coef`.

    Example:

    ```python
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> config = MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
    ...                        output_router_logits=True)
    >>> adds_router_loss(MixtralForCausalLM(config))
    True
    ```
    """
    config = getattr(unwrap_model(model), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    return bool(getattr(config, "output_router_logits", False)) and bool(coef)


def _router_recorder(model: nn.Module) -> tuple[type[nn.Module], int]:
    """The router class and output index that transformers itself records `router_logits` from."""
    for module in unwrap_model(model).modules():
        spec = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        if isinstance(spec, type):
            return spec, 0
        target = getattr(spec, "target_class", None)
        if isinstance(target, type):
            return target, int(getattr(spec, "index", 0) or 0)
    raise ValueError(
        f"{type(unwrap_model(model)).__name__} declares no `router_logits` output (`_can_record_outputs`): it is not "
        "a transformers mixture-of-experts model whose router logits can be read."
    )


def find_router_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """
    The router modules of a transformers MoE model (the modules transformers records `router_logits` from), each
    with the index of the logits in its output, in forward order. Sees through PEFT, DDP and `torch.compile`.

    Example:

    ```python
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> config = MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    ...                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    >>> len(find_router_modules(MixtralForCausalLM(config)))
    2
    ```
    """
    target, index = _router_recorder(model)
    routers = [(m, index) for m in unwrap_model(model).modules() if isinstance(m, target)]
    if not routers:
        raise ValueError(f"No {target.__name__} module found in {type(unwrap_model(model)).__name__}.")
    return routers


@contextlib.contextmanager
def capture_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect every router's logits (`[rows, E]`, with their autograd graph) during the forwards in the block."""
    captured: list[torch.Tensor] = []
    handles = []
    for module, index in find_router_modules(model):

        def hook(_module: nn.Module, _inputs: Any, output: Any, index: int = index) -> None:
            logits = output[index] if isinstance(output, (tuple, list)) else output
            captured.append(logits)

        handles.append(module.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


class WindowRouterBalance:
    """
    Exact load balancing over a window of micro-batches for a transformers MoE model: the window's router
    statistics come from a forward-only pass ([`prepare_window`]), then each micro-batch's loss carries its exact
    share of the window's auxiliary loss ([`micro_batch_loss`]), scaled for the accumulator's item weighting.

    Args:
        model (`nn.Module`): the MoE model (PEFT-, DDP- or compile-wrapped is fine); forwards go through it.
        router_aux_loss_coef (`float`, *optional*): defaults to `config.router_aux_loss_coef`.
        num_experts_per_tok (`int`, *optional*): top-k; defaults to `config.num_experts_per_tok`.
        shift_labels (`bool`, *optional*, defaults to `True`): count items as a causal LM's loss sees them.

    Under `torch.distributed` with more than one rank, the window's counts are all-reduced (one collective per
    window), so every rank uses the statistics of the large batch over all ranks; every rank must call
    [`prepare_window`] for every window.

    Example:

    ```python
    >>> balance = WindowRouterBalance(model)  # doctest: +SKIP
    >>> for window in windows:  # doctest: +SKIP
    ...     items = balance.prepare_window(window)  # forward-only pass, returns each micro-batch's items
    ...     for batch, n in zip(window, items):
    ...         with accumulator.accumulate(model):
    ...             accumulator.backward(balance.micro_batch_loss(batch, n), num_items=n)
    ...     accumulator.step(optimizer)
    ```
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        router_aux_loss_coef: float | None = None,
        num_experts_per_tok: int | None = None,
        shift_labels: bool = True,
    ) -> None:
        self.model = model
        config = getattr(unwrap_model(model), "config", None)
        coef = (
            router_aux_loss_coef if router_aux_loss_coef is not None else getattr(config, "router_aux_loss_coef", None)
        )
        top_k = (
            num_experts_per_tok if num_experts_per_tok is not None else getattr(config, "num_experts_per_tok", None)
        )
        if coef is None or top_k is None:
            raise ValueError(
                "WindowRouterBalance needs `router_aux_loss_coef` and `num_experts_per_tok` (from the model's config "
                f"or as arguments); {type(unwrap_model(model)).__name__}'s config has coef={coef}, top_k={top_k}."
            )
        self.router_aux_loss_coef = float(coef)
        self.top_k = int(top_k)
        self.shift_labels = shift_labels
        find_router_modules(model)  # fail now, not mid-training, on a model without routers
        self.window: RouterCounts | None = None

    def count_items(self, batch: Mapping[str, Any]) -> int:
        """Items a micro-batch's language-model loss is a mean over (shifted labels for a causal LM)."""
        return count_items_in_batch(batch, shift_labels=self.shift_labels)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def prepare_window(self, batches: Sequence[Mapping[str, Any]], num_items: Sequence[float] | None = None) -> list:
        """
        Forward-only pass over the window's micro-batches (no labels, no gradients, the model's current train/eval
        mode), counting its expert assignments, router rows and items (all-reduced across ranks). The torch RNG
        state is restored afterwards, so the training forwards draw the same random values (router jitter,
        dropout) and route exactly as counted. Returns each micro-batch's item count (`num_items`, or counted).
        """
        if num_items is None:
            num_items = [self.count_items(b) for b in batches]
        if len(num_items) != len(batches):
            raise ValueError(f"`num_items` has {len(num_items)} entries for {len(batches)} micro-batches.")
        rng = capture_rng_state()
        device = self._device()
        total: RouterCounts | None = None
        try:
            for batch, n in zip(batches, num_items, strict=True):
                inputs = {k: v for k, v in _to_device(batch, device).items() if k not in ("labels", "shift_labels")}
                inputs["output_router_logits"] = False
                with capture_router_logits(self.model) as logits:
                    self.model(**inputs)
                counts = router_counts(logits, logits[0].shape[-1], self.top_k, inputs.get("attention_mask"), n)
                total = counts if total is None else total + counts
        finally:
            restore_rng_state(rng)
        self.window = total.all_reduce()
        return list(num_items)

    def aux_term(
        self, router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None, num_items: float
    ) -> torch.Tensor:
        """`router_aux_loss_coef * a_k * N / n_k` for a micro-batch of the prepared window (see `exact_aux_term`)."""
        if self.window is None:
            raise RuntimeError("Call `prepare_window(window)` before the window's micro-batch losses.")
        return self.router_aux_loss_coef * exact_aux_term(router_logits, self.window, attention_mask, num_items)

    def micro_batch_loss(self, batch: Mapping[str, Any], num_items: float | None = None) -> torch.Tensor:
        """
        Forward one micro-batch of the prepared window and return its language-model mean loss plus its exact share
        of the window's auxiliary loss, scaled for the accumulator (pass the same `num_items` to
        `accumulator.backward`).
        """
        n = self.count_items(batch) if num_items is None else num_items
        inputs = _to_device(batch, self._device())
        inputs["output_router_logits"] = False  # the model's own per-micro-batch aux loss is off
        with capture_router_logits(self.model) as logits:
            lm_loss = self.model(**inputs).loss
        return lm_loss + self.aux_term(logits, inputs.get("attention_mask"), n).to(lm_loss.device)

    @property
    def window_aux_loss(self) -> float | None:
        """The prepared window's auxiliary loss value (the large batch's, over all ranks), before the coefficient."""
        return None if self.window is None else self.window.aux_loss


class MoEWindowMode:
    """
    The `moe_load_balance="window"` mode of [`GradAccumTrainer`]: exact window-level load balancing, about one extra
    forward per micro-batch. The Trainer calls it from its public hooks:

    - `get_batch_samples` -> [`window_prefetched`]: the window is first run forward-only to count its routing;
    - `compute_loss` -> [`compute_loss`]: the per-micro-batch auxiliary loss is replaced by the micro-batch's exact
      share of the window's. TRL's `SFTTrainer` adds its own router term divided by
      `current_gradient_accumulation_steps`; that term is switched off (`aux_loss_enabled`) for the training
      forwards, so nothing is divided twice.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumArguments, GradAccumTrainer
    >>> args = GradAccumArguments("out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
    ...                           moe_load_balance="window")
    >>> trainer = GradAccumTrainer(model=moe_model, args=args, train_dataset=ds)  # doctest: +SKIP
    ```
    """

    def __init__(self, model: nn.Module) -> None:
        self.balance = WindowRouterBalance(model, shift_labels=True)

    def window_prefetched(self, trainer: Any, batches: list[Any]) -> None:
        if not batches:
            return
        balance = self.balance
        balance.model = trainer.model_wrapped if getattr(trainer, "model_wrapped", None) is not None else trainer.model
        # `training_step` puts the model in train mode: count the routing as those forwards will route (jitter).
        was_training = balance.model.training
        balance.model.train()
        try:
            balance.prepare_window(batches, [int(trainer.count_micro_batch_items(b)) for b in batches])
        finally:
            balance.model.train(was_training)

    def compute_loss(
        self,
        trainer: Any,
        parent_compute_loss: Any,
        model: nn.Module,
        inputs: Any,
        return_outputs: bool,
        num_items: Any,
    ) -> Any:
        """`parent_compute_loss` (the composed trainer's) with the model's own auxiliary loss off, plus this
        micro-batch's exact share of the window's auxiliary loss."""
        inputs = dict(inputs)
        inputs["output_router_logits"] = False  # the model's own per-micro-batch aux loss is off
        trl_aux = getattr(trainer, "aux_loss_enabled", None)
        if trl_aux is not None:
            # TRL's SFTTrainer: its per-micro-batch router term (divided by steps) off.
            trainer.aux_loss_enabled = False
        try:
            with capture_router_logits(model) as logits:
                result = parent_compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items
                )
        finally:
            if trl_aux is not None:
                trainer.aux_loss_enabled = trl_aux
        # TRL recomputes outputs with a second forward when asked for them; the first forward's routers are ours.
        logits = logits[: len(find_router_modules(model))]
        loss = result[0] if return_outputs else result
        items = int(trainer.count_micro_batch_items(inputs))
        loss = loss + self.balance.aux_term(logits, inputs.get("attention_mask"), items).to(loss.device)
        return (loss, result[1]) if return_outputs else loss


def window_router_mode(model: nn.Module, *, named: bool) -> MoEWindowMode:
    """
    The exact window mode for `model`'s router loss. A router it cannot read (top-1 routers without
    `num_experts_per_tok`, encoder-decoder MoE) raises the `ValueError` naming it where the mode was asked for by
    name, and a `ModelLossError` with the cause and the fix where `"auto"` chose it.

    Example:

    ```python
    >>> mode = window_router_mode(mixtral_model, named=False)  # doctest: +SKIP
    ```
    """
    try:
        return MoEWindowMode(model)
    except ValueError as error:
        if named:
            raise
        raise ModelLossError(
            f"{type(unwrap_model(model)).__name__} adds a router load-balancing loss, a statistic of its batch (per "
            f"micro-batch another objective), and the exact window mode cannot read its routers ({error}). Stopped "
            'before the first optimizer step.\nFix: `moe_load_balance="micro_batch"` to keep the per-micro-batch '
            "router term knowingly, or `gradient_accumulation_steps=1` with the batch you want."
        ) from error
