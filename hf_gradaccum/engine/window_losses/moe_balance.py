"""Exact window-level mixture-of-experts load balancing: the torch-only math.

The Switch-Transformer auxiliary loss that transformers' MoE models add (`load_balancing_loss_func`) is, over a
batch of `T` unmasked tokens and `L` router layers with `E` experts and top-`k` routing,

    aux = E * sum_e f_e * P_e,    f_e = C_e / (L * T),    P_e = S_e / (L * T),

with `C_e` the number of (layer, token, top-k slot) assignments to expert `e` (not differentiable) and `S_e` the sum
of the router probabilities of `e` over the same (layer, token) rows (differentiable). It is not a mean over
independent items: `f_e` and the denominators belong to the whole batch, so per micro-batch it is a different
statistic. Over a window of micro-batches `k` (the large batch), `S_e = sum_k S_e^k`, hence

    aux_W = sum_k a_k,    a_k = E * sum_e f_e^W * S_e^k / (L * T_W),

where `f_e^W` and `T_W` are the window's. Each `a_k` depends only on micro-batch `k`'s forward once the window's
counts are known, and its gradient is micro-batch `k`'s exact share of the large batch's. The accumulator weights a
micro-batch's loss by `n_k / N` (its share of the window's items), so the term handed to it is `a_k * N / n_k`.

This module computes the counts ([`router_counts`]), merges them over a window (and across ranks), and builds that
term ([`exact_aux_term`]). Reading router logits from a transformers model is in `losses/moe.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MOE_LOAD_BALANCE_MODES", "RouterCounts", "check_moe_load_balance", "exact_aux_term", "router_counts"]

# "micro_batch": each micro-batch's own auxiliary loss, weighted by its share of the window's items (cheap, inexact).
# "window": the window's routing statistics, from a forward-only first pass (exact, about one extra forward).
# "auto": "window" where the model adds a router auxiliary loss.
MOE_LOAD_BALANCE_MODES = ("auto", "micro_batch", "window")


def check_moe_load_balance(mode: str) -> str:
    """Return `mode` if it is one of `MOE_LOAD_BALANCE_MODES`, else raise a `ValueError` naming the argument."""
    if mode not in MOE_LOAD_BALANCE_MODES:
        raise ValueError(f"`moe_load_balance` must be one of {MOE_LOAD_BALANCE_MODES}, got {mode!r}.")
    return mode


@dataclass
class RouterCounts:
    """
    Routing statistics of some tokens (a micro-batch, a window, or a window over all ranks).

    Attributes:
        expert_counts (`torch.Tensor`): float64 `[E]`, top-k assignments per expert summed over layers (`C_e`).
        prob_sums (`torch.Tensor`): float64 `[E]`, router probabilities per expert summed over layers and tokens
            (`S_e`, detached: only used for the loss value).
        rows (`float`): unmasked (layer, token) rows, `L * T`.
        items (`float`): items the language-model loss is a mean over (what the accumulator weights by).
    """

    expert_counts: torch.Tensor
    prob_sums: torch.Tensor
    rows: float
    items: float = 0.0

    def __add__(self, other: RouterCounts) -> RouterCounts:
        return RouterCounts(
            self.expert_counts + other.expert_counts,
            self.prob_sums + other.prob_sums,
            self.rows + other.rows,
            self.items + other.items,
        )

    @property
    def num_experts(self) -> int:
        return self.expert_counts.numel()

    @property
    def aux_loss(self) -> float:
        """The auxiliary loss of these tokens as one batch, `E * sum_e f_e * P_e` (what the model would report)."""
        if self.rows == 0:
            return 0.0
        return float(self.num_experts * (self.expert_counts * self.prob_sums).sum() / self.rows**2)

    def all_reduce(self) -> RouterCounts:
        """Summed over all `torch.distributed` ranks (one collective), as the large batch over all ranks sees them.
        Returns `self` outside a process group of more than one rank."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self
        e = self.num_experts
        device = self.expert_counts.device
        if dist.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        flat = torch.cat(
            [self.expert_counts, self.prob_sums, torch.tensor([self.rows, self.items], dtype=torch.float64)]
        ).to(device)
        dist.all_reduce(flat)
        flat = flat.cpu()
        return RouterCounts(flat[:e].clone(), flat[e : 2 * e].clone(), float(flat[2 * e]), float(flat[2 * e + 1]))


def _flat_mask(attention_mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"`attention_mask` must be 2-D [batch, sequence] (as load_balancing_loss_func expects), got shape "
            f"{tuple(attention_mask.shape)}."
        )
    flat = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    if flat.numel() != rows:
        raise ValueError(
            f"`attention_mask` has {flat.numel()} positions but the router logits have {rows} rows per layer."
        )
    return flat


def _layer_probs(router_logits: Sequence[torch.Tensor], num_experts: int) -> list[torch.Tensor]:
    if not router_logits:
        raise ValueError("`router_logits` is empty: the model's routers produced no logits.")
    layers = [layer.reshape(-1, layer.shape[-1]) for layer in router_logits]
    for layer in layers:
        if layer.shape[-1] != num_experts:
            raise ValueError(f"router logits have {layer.shape[-1]} experts, `num_experts` is {num_experts}.")
    return layers


def router_counts(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    items: float = 0.0,
) -> RouterCounts:
    """
    The routing statistics of one micro-batch, as transformers' `load_balancing_loss_func` counts them: softmax per
    layer, top-`k` experts per row, rows masked by the 2-D `attention_mask` (every row counts without one).

    Args:
        router_logits (sequence of `torch.Tensor`): one `[rows, E]` tensor per MoE layer (`outputs.router_logits`).
        num_experts (`int`): `E`.
        top_k (`int`): experts per token (`config.num_experts_per_tok`).
        attention_mask (`torch.Tensor`, *optional*): `[batch, sequence]`, 1 for real tokens.
        items (`float`, *optional*): the micro-batch's loss items, carried along for the window total.

    Example:

    ```python
    >>> import torch
    >>> logits = [torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]])]
    >>> router_counts(logits, num_experts=3, top_k=1).expert_counts.tolist()
    [1.0, 1.0, 0.0]
    ```
    """
    layers = _layer_probs(router_logits, num_experts)
    with torch.no_grad():
        device = layers[0].device
        mask = _flat_mask(attention_mask, layers[0].shape[0], device)
        counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
        prob_sums = torch.zeros(num_experts, dtype=torch.float64, device=device)
        rows = 0.0
        for layer in layers:
            probs = torch.softmax(layer.float(), dim=-1)
            selected = torch.topk(probs, top_k, dim=-1).indices
            weights = torch.ones_like(selected, dtype=torch.float64) if mask is None else mask.double()[:, None]
            counts.scatter_add_(0, selected.reshape(-1), weights.expand_as(selected).reshape(-1))
            w = 1.0 if mask is None else mask.double()[:, None]
            prob_sums += (probs.double() * w).sum(0)
            rows += float(probs.shape[0] if mask is None else mask.sum())
    return RouterCounts(counts.cpu(), prob_sums.cpu(), rows, float(items))


def exact_aux_term(
    router_logits: Sequence[torch.Tensor],
    window: RouterCounts,
    attention_mask: torch.Tensor | None = None,
    num_items: float | None = None,
) -> torch.Tensor:
    """
    Micro-batch `k`'s exact share of the window's auxiliary loss, `a_k = E * sum_e f_e^W * S_e^k / (L * T_W)`, with
    `f_e^W` and `L * T_W` from `window` (the counts of the whole window, over all ranks). Summed over the window's
    micro-batches it equals the large batch's auxiliary loss, value and gradient.

    With `num_items` (this micro-batch's `n_k`), returns `a_k * N / n_k` (`N = window.items`): the term to add to a
    micro-batch *mean* loss that the accumulator weights by `n_k / N`. A micro-batch with `n_k = 0` cannot carry a
    term (the accumulator gives it weight 0); a `ValueError` says so when it has routed tokens.

    Example:

    ```python
    >>> import torch
    >>> a = [torch.randn(4, 3, requires_grad=True)]
    >>> b = [torch.randn(6, 3, requires_grad=True)]
    >>> window = router_counts(a, 3, 2) + router_counts(b, 3, 2)
    >>> total = exact_aux_term(a, window) + exact_aux_term(b, window)
    >>> abs(float(total.detach()) - window.aux_loss) < 1e-5  # the large batch's aux loss
    True
    ```
    """
    layers = _layer_probs(router_logits, window.num_experts)
    device = layers[0].device
    mask = _flat_mask(attention_mask, layers[0].shape[0], device)
    if window.rows == 0:
        return layers[0].sum() * 0.0
    fractions = (window.expert_counts / window.rows).to(device=device, dtype=torch.float32)
    prob_sum = None
    for layer in layers:
        probs = torch.softmax(layer.float(), dim=-1)
        summed = (probs if mask is None else probs * mask[:, None]).sum(0)
        prob_sum = summed if prob_sum is None else prob_sum + summed
    term = window.num_experts * (fractions * prob_sum).sum() / window.rows
    if num_items is None:
        return term
    n = float(num_items)
    if n == 0:
        routed = float(mask.sum()) if mask is not None else float(layers[0].shape[0])
        if routed > 0:
            raise ValueError(
                "A micro-batch with 0 loss items but routed tokens: the accumulator gives it weight 0, so its share of "
                "the window's load-balancing loss would be lost. Drop such micro-batches (e.g. rows whose labels are "
                "all -100) or use `moe_load_balance='micro_batch'`."
            )
        return term * 0.0
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"`num_items` must be a finite number >= 0, got {num_items!r}.")
    return term * (window.items / n)
