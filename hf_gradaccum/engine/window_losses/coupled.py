"""Exact large batches for losses that couple the batch (in-batch negatives): gradient caching on top of
`GradientAccumulator`.

A contrastive loss over a window of `N` samples is not a mean of per-micro-batch losses: every sample is a negative
for every other, so accumulating each micro-batch's own loss trains a weaker objective (a batch of 16 accumulated 8
times sees 15 negatives per anchor instead of 127). Gradient caching computes the large-batch gradient exactly, at
the memory of one micro-batch plus the window's representations:

1. **Pass 1** (no autograd graph): each micro-batch's representations `r_k = embed_fn(model, batch_k)`. The RNG
   states (torch CPU and CUDA, numpy, Python `random`) are saved before each micro-batch, so that dropout and any
   random layer can draw the same values again in pass 2. Micro-batch 0 is the exception (`keep_first_graph`): its
   forward keeps its graph, because its pass 2 comes right after the window loss and can use it as it is.
2. **The window loss**: `L = loss_fn(R, model)` on the representations of the whole window (under `torch.distributed`, of
   every rank: they are all-gathered, as the large batch over all ranks would see them), with `R` detached leaves;
   autograd gives `g_k = dL/dr_k` and the gradient of any parameter the loss uses itself (CLIP's `logit_scale`).
3. **Pass 2**: for each micro-batch, restore its RNG states, recompute `r_k` with a graph and back-propagate the
   cached `g_k` through the accumulator: `accumulate_micro_batch` receives the surrogate
   `s_k = (r_k * g_k).sum() * N / n_k` (value replaced by `L`), and the accumulator's item weighting `n_k / N` turns
   it into `J_k^T g_k`; summed over micro-batches (and ranks, by the accumulator's window-end all-reduce) that is
   the large-batch gradient `dL/dtheta`. The loss parameters' gradient enters through the first micro-batch's
   surrogate (divided by the world size: every rank computes the same one).

So the accumulator's fp32 buffers, fp16 loss scaling (an overflowing micro-batch is recomputed: its RNG states are
restored again), DDP reduction and checkpoints work as for any other loss. Ordinary item-mean loss terms can be
added per micro-batch (`item_loss_fn`); they keep their item weighting.

Limits: a window must be run as a whole by [`CoupledLoss.accumulate_window`] (the loss needs every representation
before any backward), so a checkpoint is taken between windows (`state_dict` mid-window is refused while a coupled
window runs); an out-of-memory error discards the window, restores the RNG to the window's start and re-raises, so the
caller can redo the window with smaller micro-batches (exact again: both passes are redone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..accumulator import GradientAccumulator
from ..rng import RNGState, capture_rng_state, restore_rng_state

__all__ = ["CoupledLoss", "CoupledWindow"]

Representations = Any  # a tensor, or a (nested) tuple/list/dict of tensors


# ---------------------------------------------------------------------------------------------------- structures
def flatten_representations(reps: Representations) -> tuple[list[torch.Tensor], Callable[[list], Any]]:
    """The tensors of `reps` (tensor, tuple/list/dict, nested) in a fixed order, and a function that rebuilds the
    same structure from a list of tensors in that order."""
    if torch.is_tensor(reps):
        return [reps], lambda leaves: leaves[0]
    if isinstance(reps, Mapping):
        keys = list(reps)
        parts = [flatten_representations(reps[k]) for k in keys]
    elif isinstance(reps, (tuple, list)):
        keys = None
        parts = [flatten_representations(r) for r in reps]
    else:
        raise TypeError(f"`embed_fn` must return a tensor or a tuple/list/dict of tensors, got {type(reps).__name__}.")
    sizes = [len(leaves) for leaves, _ in parts]
    leaves = [t for part, _ in parts for t in part]

    def rebuild(new_leaves: list) -> Any:
        out, start = [], 0
        for size, (_, sub_rebuild) in zip(sizes, parts, strict=True):
            out.append(sub_rebuild(new_leaves[start : start + size]))
            start += size
        if keys is not None:
            return dict(zip(keys, out, strict=True))
        return type(reps)(out) if isinstance(reps, tuple) and not hasattr(reps, "_fields") else list(out)

    return leaves, rebuild


def rows_in(batch: Any) -> int:
    """Rows of a micro-batch: the first dimension of its first batched tensor (searched through dicts/sequences)."""
    if torch.is_tensor(batch) and batch.dim() > 0:
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        try:
            return rows_in(value)
        except ValueError:
            continue
    raise ValueError(
        f"Cannot count the rows of a micro-batch of type {type(batch).__name__}: pass `num_items_fn` to CoupledLoss."
    )


def _distributed_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def all_gather_rows(tensor: torch.Tensor, world_size: int) -> tuple[torch.Tensor, list[int]]:
    """Concatenate `tensor` of every rank along dim 0, in rank order (ranks may hold different numbers of rows).
    Returns the gathered tensor and each rank's row count."""
    dist = torch.distributed
    rows = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    all_rows = [torch.zeros_like(rows) for _ in range(world_size)]
    dist.all_gather(all_rows, rows)
    counts = [int(r.item()) for r in all_rows]
    longest = max(counts)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)]), counts


# ---------------------------------------------------------------------------------------------------- the window
@dataclass
class CoupledWindow:
    """What pass 1 leaves for pass 2: per micro-batch its RNG states, representations and their cached gradients."""

    rng_states: list[RNGState]
    representations: list[list[torch.Tensor]]
    """Pass-1 representations of this rank's micro-batches (kept to check pass 2 against them)."""
    representation_grads: list[list[torch.Tensor | None]]
    """`dL/dr_k` for each of this rank's micro-batches (`None` for leaves that are not floating point)."""
    num_items: list[float]
    total_items: float
    """Items of the whole window, summed over ranks (the accumulator divides by the same sum)."""
    loss: torch.Tensor
    """The window loss `L` (detached), the same on every rank."""
    loss_parameter_grads: list[tuple[nn.Parameter, torch.Tensor]]
    """Parameters the loss uses itself (not through the representations), with `dL/dparam`."""
    world_size: int
    rng_after: RNGState
    recompute_max_abs_diff: list[float] = field(default_factory=list)
    first_graph: list[torch.Tensor] | None = None
    rebuild: Callable[[list], Any] | None = None
    """Micro-batch 0's pass-1 representations with their autograd graph (`keep_first_graph`): pass 2 uses them once
    instead of recomputing them, then drops them."""


class CoupledLoss:
    """
    Gradient caching for a loss over the whole accumulation window (in-batch negatives: CLIP, multiple-negatives
    ranking, DPR), exact to the large-batch step, run through a [`GradientAccumulator`].

    Args:
        embed_fn (`Callable[[nn.Module, Any], Representations]`):
            `embed_fn(model, micro_batch)` returns the micro-batch's representations: a tensor or a (nested)
            tuple/list/dict of tensors, each with the micro-batch's rows along dim 0. Called twice per micro-batch
            (without and with autograd), with the same RNG states. Non-floating tensors (e.g. labels) are passed to
            `loss_fn` without gradients.
        loss_fn (`Callable[[Representations, nn.Module], torch.Tensor]`):
            `loss_fn(window_representations, model)` returns the scalar loss of the window; `window_representations` has
            the structure `embed_fn` returns, each tensor concatenated over the window's micro-batches (and, under
            `torch.distributed`, over ranks in rank order). Everything the loss needs from the batches (labels,
            ids) must be in the representations, so that it is gathered across ranks too. Parameters of `model` it
            uses itself (a learnable temperature) get their gradient directly; `model` is the one given to
            `embed_fn` (possibly DDP-wrapped: use `model.module` there).
        item_loss_fn (`Callable[[Any, Representations], torch.Tensor]`, *optional*):
            An ordinary loss term, a mean over one micro-batch's `num_items_fn(batch)` items, added to the coupled
            loss with the usual item weighting: `item_loss_fn(micro_batch, representations)` (pass 2 only).
        num_items_fn (`Callable[[Any], float]`, *optional*):
            Items of a micro-batch (the accumulator weights by them). Defaults to its rows.
        gather_across_ranks (`bool`, *optional*):
            All-gather the representations of every rank into the window. Defaults to `True` when a process group
            with more than one rank is initialised.
        check_recompute (`bool`, *optional*, defaults to `False`):
            Compare each micro-batch's pass-2 representations with pass 1 and raise if they are not bitwise equal
            (a random layer drawing from a generator that is not restored, or non-deterministic kernels).
        keep_first_graph (`bool`, *optional*, defaults to `True`):
            Run micro-batch 0's pass-1 forward with autograd and keep its graph for its pass 2, which then needs no
            recompute: one forward fewer per window. Pass 2 of micro-batch 0 comes right after the window loss (in
            a Trainer and in [`~CoupledLoss.accumulate_window`] alike), so that graph is never held together with
            another micro-batch's; what it adds to the peak is the no-graph forwards of the other micro-batches.

    Example (a plain loop; in-batch negatives over the whole window of 8 samples, 4 per micro-batch):

    ```python
    >>> import torch
    >>> from hf_gradaccum import GradientAccumulator
    >>> from hf_gradaccum.engine.window_losses.coupled import CoupledLoss
    >>> model = torch.nn.Linear(6, 4)
    >>> def embed(model, batch):
    ...     return {"query": model(batch["query"]), "doc": model(batch["doc"])}
    >>> def in_batch_negatives(reps, model):
    ...     scores = reps["query"] @ reps["doc"].T
    ...     return torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))
    >>> coupled = CoupledLoss(embed, in_batch_negatives)
    >>> accumulator = GradientAccumulator(model, gradient_accumulation_steps=2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> window = [{"query": torch.randn(4, 6), "doc": torch.randn(4, 6)} for _ in range(2)]
    >>> loss = coupled.accumulate_window(accumulator, model, window)
    >>> result = accumulator.step(optimizer)
    >>> result.applied
    True
    ```
    """

    def __init__(
        self,
        embed_fn: Callable[[nn.Module, Any], Representations],
        loss_fn: Callable[[Representations, nn.Module], torch.Tensor],
        *,
        item_loss_fn: Callable[[Any, Representations], torch.Tensor] | None = None,
        num_items_fn: Callable[[Any], float] | None = None,
        gather_across_ranks: bool | None = None,
        check_recompute: bool = False,
        keep_first_graph: bool = True,
    ) -> None:
        for name, fn in (("embed_fn", embed_fn), ("loss_fn", loss_fn)):
            if not callable(fn):
                raise ValueError(f"`{name}` must be callable, got {type(fn).__name__}.")
        for name, fn in (("item_loss_fn", item_loss_fn), ("num_items_fn", num_items_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{name}` must be callable or None, got {type(fn).__name__}.")
        if gather_across_ranks is not None and not isinstance(gather_across_ranks, bool):
            raise ValueError(f"`gather_across_ranks` must be None (auto), True or False, got {gather_across_ranks!r}.")
        self.embed_fn = embed_fn
        self.loss_fn = loss_fn
        self.item_loss_fn = item_loss_fn
        self.num_items_fn = num_items_fn or rows_in
        self.gather_across_ranks = gather_across_ranks
        self.check_recompute = bool(check_recompute)
        self.keep_first_graph = bool(keep_first_graph)
        self.last_window: CoupledWindow | None = None

    # ------------------------------------------------------------------ pass 1 and the window loss
    def _world(self) -> tuple[int, int]:
        world, rank = _distributed_world()
        if self.gather_across_ranks is False:
            return 1, 0
        if self.gather_across_ranks and world == 1:
            return 1, 0
        return world, rank

    def prepare_window(
        self, model: nn.Module, micro_batches: Sequence[Any], parameters: Sequence[nn.Parameter] | None = None
    ) -> CoupledWindow:
        """
        Pass 1 and the window loss: representations of every micro-batch without a graph (RNG states saved), the
        loss over the window (gathered across ranks) and its gradient with respect to the representations and to
        the trainable `parameters` (defaults to the model's) that the loss uses directly.
        """
        if len(micro_batches) == 0:
            raise ValueError("`micro_batches` is empty: a coupled window needs at least one micro-batch.")
        if parameters is None:
            parameters = [p for p in model.parameters() if p.requires_grad]
        world, rank = self._world()
        rng_states, local_reps, num_items, rebuild, first_graph = [], [], [], None, None
        keep_first = self.keep_first_graph and torch.is_grad_enabled()
        for index, batch in enumerate(micro_batches):
            n = float(self.num_items_fn(batch))
            if not n > 0:
                raise ValueError(f"Every micro-batch of a coupled window needs items > 0, got {n}.")
            num_items.append(n)
            rng_states.append(capture_rng_state())
            if index == 0 and keep_first:
                # Its backward comes later, inside the accumulator's no-sync context: a DDP forward must already be
                # in one, or DDP would prepare an all-reduce of its own for that backward.
                no_sync = getattr(model, "no_sync", None)
                with no_sync() if callable(no_sync) else contextlib.nullcontext():
                    leaves, rebuild = flatten_representations(self.embed_fn(model, batch))
                first_graph = leaves
            else:
                with torch.no_grad():
                    leaves, rebuild = flatten_representations(self.embed_fn(model, batch))
            local_reps.append([t.detach() for t in leaves])
        rng_after = capture_rng_state()

        # The window: this rank's micro-batches in order, then (distributed) every rank's, in rank order.
        num_leaves = len(local_reps[0])
        if any(len(reps) != num_leaves for reps in local_reps):
            raise ValueError("`embed_fn` returned a different structure for different micro-batches.")
        local_cat = [torch.cat([reps[i] for reps in local_reps]) for i in range(num_leaves)]
        offset = 0
        total_items = sum(num_items)
        if world > 1:
            gathered, offsets = [], None
            for leaf in local_cat:
                full, counts = all_gather_rows(leaf, world)
                gathered.append(full)
                offsets = counts
            offset = sum(offsets[:rank])
            items = torch.tensor([total_items], dtype=torch.float64, device=local_cat[0].device)
            torch.distributed.all_reduce(items)
            total_items = float(items.item())
        else:
            gathered = local_cat
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in gathered]
        with torch.enable_grad():
            loss = self.loss_fn(rebuild(leaves), model)
            if not (torch.is_tensor(loss) and loss.dim() == 0):
                raise ValueError("`loss_fn` must return a scalar tensor.")
            grad_leaves = [t for t in leaves if t.requires_grad]
            trainable = [p for p in parameters if p.requires_grad]
            grads = torch.autograd.grad(loss, [*grad_leaves, *trainable], allow_unused=True)
        rep_grads_full = iter(grads[: len(grad_leaves)])
        full_grads = [next(rep_grads_full) if t.requires_grad else None for t in leaves]
        loss_parameter_grads = [
            (p, g) for p, g in zip(trainable, grads[len(grad_leaves) :], strict=True) if g is not None
        ]

        # This rank's slice of each gradient, split per micro-batch.
        sizes = [reps[0].shape[0] for reps in local_reps]
        local_rows = sum(sizes)
        rep_grads: list[list[torch.Tensor | None]] = [[] for _ in micro_batches]
        for i, g in enumerate(full_grads):
            if g is None:
                zero = torch.zeros_like(local_cat[i]) if local_cat[i].is_floating_point() else None
                parts = [None] * len(sizes) if zero is None else list(zero.split(sizes))
            else:
                parts = list(g[offset : offset + local_rows].split(sizes))
            for k, part in enumerate(parts):
                rep_grads[k].append(part)
        return CoupledWindow(
            rng_states=rng_states,
            representations=local_reps,
            representation_grads=rep_grads,
            num_items=num_items,
            total_items=total_items,
            loss=loss.detach(),
            loss_parameter_grads=loss_parameter_grads,
            world_size=world,
            rng_after=rng_after,
            first_graph=first_graph,
            rebuild=rebuild,
        )

    # ------------------------------------------------------------------ pass 2
    def micro_batch_loss(self, window: CoupledWindow, model: nn.Module, index: int, micro_batch: Any) -> torch.Tensor:
        """
        Pass 2 for micro-batch `index`: restore its RNG states, recompute its representations with a graph, and
        return the surrogate loss for `accumulator.backward(surrogate, window.num_items[index])`: its value is the
        window loss (plus `item_loss_fn`'s term), its gradient after the accumulator's weighting is `J_k^T g_k`.
        Safe to call again for the same micro-batch (fp16 overflow recompute): the RNG states are restored each time.
        """
        if index == 0 and window.first_graph is not None:
            # Pass 1 kept this graph: used once (an fp16 overflow recompute of this micro-batch runs the forward).
            leaves, window.first_graph = window.first_graph, None
            reps = window.rebuild(leaves) if window.rebuild is not None else leaves
        else:
            restore_rng_state(window.rng_states[index])
            reps = self.embed_fn(model, micro_batch)
            leaves, _ = flatten_representations(reps)
        if self.check_recompute:
            self._compare(window, index, leaves)
        n = window.num_items[index]
        weight = window.total_items / n
        terms = [
            (r * g.to(r.dtype)).sum()
            for r, g in zip(leaves, window.representation_grads[index], strict=True)
            if g is not None
        ]
        if index == 0:
            # The loss's own parameters: once per window and rank, shared out over the ranks that all computed it.
            terms += [(p * (g / window.world_size).to(p.dtype)).sum() for p, g in window.loss_parameter_grads]
        if not terms:
            raise ValueError("`embed_fn` returned no floating-point representation to back-propagate into.")
        surrogate = torch.stack([t.float() for t in terms]).sum() * weight
        value = window.loss.float()
        if self.item_loss_fn is not None:
            item_loss = self.item_loss_fn(micro_batch, reps)
            return surrogate - surrogate.detach() + value + item_loss
        return surrogate - surrogate.detach() + value

    def _compare(self, window: CoupledWindow, index: int, leaves: list[torch.Tensor]) -> None:
        diff = 0.0
        for new, old in zip(leaves, window.representations[index], strict=True):
            if new.shape != old.shape:
                raise RuntimeError(f"Pass 2 representations of micro-batch {index} have another shape than pass 1.")
            if new.is_floating_point():
                diff = max(diff, float((new.detach().float() - old.float()).abs().max()) if new.numel() else 0.0)
            elif not torch.equal(new, old):
                diff = float("inf")
        window.recompute_max_abs_diff.append(diff)
        if diff != 0.0:
            raise RuntimeError(
                f"Pass 2 recomputed micro-batch {index}'s representations differently from pass 1 (max abs difference "
                f"{diff:g}): a random layer draws from a generator that is not restored (torch CPU/CUDA, numpy and "
                "Python `random` are), or the kernels are not deterministic. The coupled gradient would not be exact."
            )

    def finish_passes(self, window: CoupledWindow) -> None:
        """Leave the RNG where one pass over the window would have left it (after pass 1)."""
        window.first_graph = None
        restore_rng_state(window.rng_after)

    # ------------------------------------------------------------------ the whole window, plain loop
    def accumulate_window(
        self, accumulator: GradientAccumulator, model: nn.Module, micro_batches: Sequence[Any]
    ) -> torch.Tensor:
        """
        Run one whole window through `accumulator`: pass 1, the window loss, pass 2 with each micro-batch's
        surrogate accumulated by `accumulator.accumulate_micro_batch` (under `accumulator.accumulate(model)`, so
        DDP's own all-reduce is off). Call `accumulator.step(optimizer)` (or `finish_window`) afterwards. The
        accumulator must be at a window start. Returns the detached window loss.

        On any error (an out-of-memory error included) the partial window is discarded from the accumulator and the
        RNG is put back where the window started, so the window can be redone, e.g. with smaller micro-batches.
        """
        if accumulator.micro_steps_in_window != 0:
            raise RuntimeError(
                "`accumulate_window` needs the accumulator at the start of a window: the coupled loss spans the "
                f"whole window, but {accumulator.micro_steps_in_window} micro-batch(es) are already accumulated."
            )
        if len(micro_batches) > accumulator.gradient_accumulation_steps:
            raise ValueError(
                f"{len(micro_batches)} micro-batches given for a window of `gradient_accumulation_steps="
                f"{accumulator.gradient_accumulation_steps}`."
            )
        rng_before = capture_rng_state()
        try:
            window = self.prepare_window(model, micro_batches, accumulator.parameters)
            for index, batch in enumerate(micro_batches):
                with accumulator.accumulate(model):
                    accumulator.accumulate_micro_batch(
                        lambda index=index, batch=batch: self.micro_batch_loss(window, model, index, batch),
                        window.num_items[index],
                    )
        except BaseException:
            if accumulator.micro_steps_in_window:
                accumulator.discard_window()
            restore_rng_state(rng_before)
            raise
        self.finish_passes(window)
        self.last_window = window
        return window.loss

    def window_loss(self, model: nn.Module, micro_batches: Sequence[Any]) -> torch.Tensor:
        """The loss of one window computed directly, with one graph (e.g. an evaluation loss); no accumulation."""
        reps = [flatten_representations(self.embed_fn(model, b)) for b in micro_batches]
        rebuild = reps[0][1]
        leaves = [torch.cat([r[0][i] for r in reps]) for i in range(len(reps[0][0]))]
        return self.loss_fn(rebuild(leaves), model)
