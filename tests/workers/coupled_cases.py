"""Cases for the coupled-loss (gradient caching) tests: tiny random-init models, uneven micro-batches, and the
hand-computed large-batch step they are compared with.

Reference with dropout ON: one autograd graph over the whole window, each micro-batch's forward run from the RNG
state it had in the coupled run's pass 1 (`rng_states`), then the window loss and one backward. It is the large-batch
gradient for exactly those dropout masks, computed without any caching. (One forward of the concatenated batch would
draw other masks, so it cannot be the reference with dropout on; with dropout OFF it is, and the tests compare with
it too.)
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum.engine.accumulator import GradientAccumulator  # noqa: E402
from hf_gradaccum.engine.rng import RNGState, capture_rng_state, restore_rng_state  # noqa: E402
from hf_gradaccum.engine.window_losses.coupled import CoupledLoss, flatten_representations  # noqa: E402

SIZES = (3, 5, 2)  # uneven micro-batches


# ---------------------------------------------------------------------------------------------------- generic
class TwoTower(nn.Module):
    """A user's own model: a shared MLP tower with dropout and a learnable temperature used only in the loss."""

    def __init__(self, dim: int = 6, dropout: float = 0.1) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 8))
        self.log_temperature = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tower(x)


def generic_coupled(model: nn.Module, **kwargs: Any) -> CoupledLoss:
    def embed(model: nn.Module, batch: dict) -> dict:
        # `target` (an int tensor) rides along with the representations, so it is gathered across ranks too.
        reps = {"q": model(batch["q"]), "d": model(batch["d"])}
        if "target" in batch:
            reps["target"] = batch["target"]
        return reps

    def loss(reps: dict, model: nn.Module) -> torch.Tensor:
        scores = reps["q"] @ reps["d"].T * getattr(model, "module", model).log_temperature.exp()
        # a user's loss: in-batch negatives with the positive at `target`, plus a batch-level variance penalty
        # `target` holds window positions; relative to its first row, so one micro-batch alone is a valid batch too
        # (without `target`: the positive of row i is row i)
        target = reps["target"] - reps["target"].min() if "target" in reps else torch.arange(len(scores))
        return nn.functional.cross_entropy(scores, target) + reps["q"].var(0).mean()

    return CoupledLoss(embed, loss, **kwargs)


def generic_batches(sizes: Sequence[int] = SIZES, seed: int = 0, offset: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    batches, start = [], offset
    for n in sizes:
        target = torch.arange(n) + start  # positives are on the diagonal of the *window*, so shifted per micro-batch
        batches.append({"q": torch.randn(n, 6, generator=g), "d": torch.randn(n, 6, generator=g), "target": target})
        start += n
    return batches


# ---------------------------------------------------------------------------------------------------- CLIP
def tiny_clip(dropout: float = 0.1, seed: int = 0) -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    common = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={**common, "vocab_size": 50, "max_position_embeddings": 16, "attention_dropout": dropout},
        vision_config={**common, "image_size": 8, "patch_size": 4, "num_channels": 3, "attention_dropout": dropout},
        projection_dim=8,
    )
    return CLIPModel(config).train()


def clip_batches(sizes: Sequence[int] = SIZES, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(1, 48, (n, 7), generator=g)
        ids[:, -1] = 49  # eos (argmax id) last, as a tokenizer would put it
        out.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn(n, 3, 8, 8, generator=g),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------- ranking
def tiny_bert(dropout: float = 0.1, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertModel(config, add_pooling_layer=False).train()


def ranking_batches(sizes: Sequence[int] = SIZES, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        batch = {}
        for side, length in (("anchor", 6), ("positive", 9)):
            ids = torch.randint(1, 60, (n, length), generator=g)
            mask = torch.ones_like(ids)
            mask[: n // 2, -2:] = 0  # some padding
            batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"] = ids, mask
        out.append(batch)
    return out


# ---------------------------------------------------------------------------------------------------- runs
def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference_gradient(
    model: nn.Module, coupled: CoupledLoss, batches: Sequence[Any], rng_states: Sequence[RNGState] | None
) -> torch.Tensor:
    """Large-batch gradient with one graph: each micro-batch's forward from `rng_states[k]` (the coupled run's
    pass-1 states; `None`: one forward of the concatenated batch, for dropout off), the window loss, one backward."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    if rng_states is None:
        keys = batches[0].keys()
        big = {k: torch.cat([b[k] for b in batches]) for k in keys}
        loss = coupled.window_loss(model, [big])
    else:
        rng_after = capture_rng_state()
        reps = []
        for state, batch in zip(rng_states, batches, strict=True):
            restore_rng_state(state)
            reps.append(flatten_representations(coupled.embed_fn(model, batch)))
        restore_rng_state(rng_after)
        leaves = [torch.cat([r[0][i] for r in reps]) for i in range(len(reps[0][0]))]
        loss = coupled.loss_fn(reps[0][1](leaves), model)
    loss.backward()
    return flat_grads(model)


def coupled_gradient(model: nn.Module, coupled: CoupledLoss, batches: Sequence[Any], **acc_kwargs: Any):
    """Gradient of the coupled mode (written by `finish_window` into `.grad`) and the window it ran."""
    model = copy.deepcopy(model)
    acc = GradientAccumulator(model, len(batches), **acc_kwargs)
    coupled.accumulate_window(acc, model, batches)
    result = acc.finish_window()
    assert result.applied, result
    grads = flat_grads(model)
    acc.remove_hooks()
    return grads, coupled.last_window, result


def plain_gradient(model: nn.Module, coupled: CoupledLoss, batches: Sequence[Any]) -> torch.Tensor:
    """Plain (item-weighted) accumulation: each micro-batch's own coupled loss, weighted by its rows."""
    model = copy.deepcopy(model)
    acc = GradientAccumulator(model, len(batches))
    for batch in batches:
        acc.backward(coupled.window_loss(model, [batch]), coupled.num_items_fn(batch))
    acc.finish_window()
    grads = flat_grads(model)
    acc.remove_hooks()
    return grads


CASES: dict[str, Callable[[float], tuple[nn.Module, CoupledLoss, list]]] = {}


def _case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


@_case("generic")
def _generic(dropout: float, **kw: Any):
    model = TwoTower(dropout=dropout)
    return model, generic_coupled(model, **kw), generic_batches()


@_case("clip")
def _clip(dropout: float, **kw: Any):
    from hf_gradaccum.losses.coupled import clip_coupled_loss

    model = tiny_clip(dropout)
    return model, clip_coupled_loss(model, **kw), clip_batches()


@_case("ranking")
def _ranking(dropout: float, **kw: Any):
    from hf_gradaccum.losses.coupled import ranking_coupled_loss

    return tiny_bert(dropout), ranking_coupled_loss(scale=20.0, symmetric=True, **kw), ranking_batches()


@_case("ranking_asymmetric")
def _ranking_asym(dropout: float, **kw: Any):
    from hf_gradaccum.losses.coupled import ranking_coupled_loss

    return tiny_bert(dropout), ranking_coupled_loss(scale=20.0, symmetric=False, **kw), ranking_batches()
