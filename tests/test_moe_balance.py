"""Exact window-level MoE load balancing (`moe_load_balance="window"`) against the hand-computed large-batch step.

The reference is one SGD(lr=1) step per window on the window's samples as one right-padded batch through the tiny
Mixtral's own loss: cross-entropy over all the window's tokens plus `router_aux_loss_coef * aux`, with `aux` the
load-balancing loss over all the window's unmasked tokens (`load_balancing_loss_func`). Micro-batches are uneven and
padded; windows are uneven too. The default per-micro-batch term's error is printed and asserted next to it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator, count_items_in_batch
from hf_gradaccum.engine.window_losses.moe_balance import exact_aux_term, router_counts
from hf_gradaccum.losses.moe import WindowRouterBalance
from tests.composition_cases import (
    NUM_SAMPLES,
    TRAIN_ARGS,
    flat_trainable,
    pad_cat,
    sgd_reference,
    text_dataset,
    tiny_mixtral,
    train_and_collect,
    update_error,
    word_tokenizer,
)

RTOL = 1e-5
PAD = {"labels": -100}


def _rows(n: int, seed: int = 1) -> list[dict]:
    tok = word_tokenizer()
    rows = []
    for text in text_dataset(n, seed=seed)["text"]:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    return rows


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return pad_cat([{k: torch.tensor([v]) for k, v in r.items()} for r in rows], PAD)


def large_batch_loss(model: torch.nn.Module, window: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The model's own loss on the whole window as one padded batch: CE over all tokens + coef * window aux."""
    batch = pad_cat([{k: v for k, v in b.items() if torch.is_tensor(v)} for b in window], PAD)
    return model(**batch, output_router_logits=True).loss


def _windows() -> list[list[dict[str, torch.Tensor]]]:
    rows = _rows(14)
    sizes = [[3, 1, 4], [2, 4]]  # uneven micro-batches, uneven windows, padding in every multi-row micro-batch
    windows, start = [], 0
    for window_sizes in sizes:
        window = []
        for size in window_sizes:
            window.append(_collate(rows[start : start + size]))
            start += size
        windows.append(window)
    return windows


def _train_plain(model, windows, mode: str) -> torch.nn.Module:
    model = copy.deepcopy(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    balance = WindowRouterBalance(model) if mode == "window" else None
    for window in windows:
        accumulator = GradientAccumulator(model, gradient_accumulation_steps=len(window))
        items = (
            balance.prepare_window(window) if balance else [count_items_in_batch(b, shift_labels=True) for b in window]
        )
        for batch, n in zip(window, items, strict=True):
            with accumulator.accumulate(model):
                loss = balance.micro_batch_loss(batch, n) if balance else model(**batch).loss
                accumulator.backward(loss, num_items=n)
        accumulator.step(optimizer)
        accumulator.remove_hooks()
    return model


@pytest.fixture(scope="module")
def start_and_windows():
    torch.manual_seed(0)
    return tiny_mixtral(), _windows()


def test_counts_match_transformers_load_balancing_loss(start_and_windows):
    """The window's aux value from the forward-only pass equals the model's own aux loss on the padded window."""
    model, windows = start_and_windows
    model = copy.deepcopy(model).train()
    balance = WindowRouterBalance(model)
    for window in windows:
        balance.prepare_window(window)
        batch = pad_cat(window, PAD)
        with torch.no_grad():
            expected = float(model(**batch, output_router_logits=True).aux_loss)
        print(f"window aux: exact-mode {balance.window_aux_loss:.8f}, large batch {expected:.8f}")
        assert abs(balance.window_aux_loss - expected) <= RTOL * abs(expected)


def test_exact_terms_sum_to_the_large_batch_aux_value_and_gradient():
    """Sum over micro-batches of `exact_aux_term` = the window's aux loss (value and gradient), masks included."""
    torch.manual_seed(0)
    layers, experts, top_k = 3, 5, 2
    shapes = [(2, 6), (1, 3), (3, 4)]
    masks = [torch.ones(s) for s in shapes]
    masks[0][1, 4:] = 0
    masks[2][0, 2:] = 0
    logits = [[torch.randn(b * t, experts, requires_grad=True) for _ in range(layers)] for b, t in shapes]
    counts = [router_counts(lg, experts, top_k, m) for lg, m in zip(logits, masks, strict=True)]
    window = counts[0] + counts[1] + counts[2]
    exact = sum(exact_aux_term(lg, window, m) for lg, m in zip(logits, masks, strict=True))
    # Reference: transformers' formula on the concatenated, masked rows of all micro-batches (layer by layer).
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    width = max(t for _, t in shapes)
    padded_mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
    padded_layers = []
    for layer in range(layers):
        parts = []
        for (b, t), lg in zip(shapes, logits, strict=True):
            part = lg[layer].reshape(b, t, experts)
            parts.append(torch.nn.functional.pad(part, (0, 0, 0, width - t)))
        padded_layers.append(torch.cat(parts).reshape(-1, experts))
    reference = load_balancing_loss_func(tuple(padded_layers), experts, top_k, padded_mask)
    assert abs(float(exact.detach()) - float(reference.detach())) <= 1e-6 * float(reference.detach())
    grads = torch.autograd.grad(exact, [t for lg in logits for t in lg])
    ref_grads = torch.autograd.grad(reference, [t for lg in logits for t in lg])
    g, r = torch.cat([x.flatten() for x in grads]), torch.cat([x.flatten() for x in ref_grads])
    assert float((g - r).norm() / r.norm()) <= 1e-6


def test_plain_loop_exact_mode_matches_the_large_batch(start_and_windows):
    model, windows = start_and_windows
    initial = flat_trainable(model)
    reference = sgd_reference(model, windows, large_batch_loss)
    exact = update_error(initial, _train_plain(model, windows, "window"), reference)
    default = update_error(initial, _train_plain(model, windows, "micro_batch"), reference)
    print(f"plain loop, relative update error vs the large batch: window {exact:.2e}, micro_batch {default:.2e}")
    assert exact <= RTOL
    assert default > 100 * exact and default > 1e-4  # the default's per-micro-batch statistic really differs


def test_zero_item_micro_batch_with_routed_tokens_is_refused(start_and_windows):
    model, windows = start_and_windows
    model = copy.deepcopy(model).train()
    balance = WindowRouterBalance(model)
    batch = dict(windows[0][0])
    batch["labels"] = torch.full_like(batch["labels"], -100)
    balance.prepare_window([batch, windows[0][1]])
    with pytest.raises(ValueError, match="0 loss items"):
        balance.micro_batch_loss(batch, 0)


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="moe_load_balance"):
        GradAccumArguments(str(tmp_path), moe_load_balance="global")


def _run_trainer(tmp, mode: str) -> float:
    torch.manual_seed(0)
    args = GradAccumArguments(str(tmp), moe_load_balance=mode, **TRAIN_ARGS)
    trainer, windows, initial, start = train_and_collect(
        GradAccumTrainer,
        args,
        model=tiny_mixtral(),
        train_dataset=_rows(NUM_SAMPLES),
        data_collator=_collate,
    )
    return update_error(initial, trainer.model, sgd_reference(start, windows, large_batch_loss))


def test_trainer_exact_mode_matches_the_large_batch(tmp_path):
    exact = _run_trainer(tmp_path / "window", "window")
    default = _run_trainer(tmp_path / "micro_batch", "micro_batch")
    print(f"GradAccumTrainer, relative update error vs the large batch: window {exact:.2e}, micro_batch {default:.2e}")
    assert exact <= RTOL
    assert default > 100 * exact and default > 1e-4


def test_sft_trainer_exact_mode_does_not_divide_the_router_loss(tmp_path):
    """TRL's SFTTrainer adds `coef * aux / current_gradient_accumulation_steps`; in window mode that term is off and
    the exact one takes its place, so the router loss is neither divided twice nor counted twice."""
    from trl import SFTTrainer

    from tests.composed_arguments import GradAccumSFTConfig

    class MoESFT(GradAccumTrainer, SFTTrainer):
        pass

    torch.manual_seed(0)
    args = GradAccumSFTConfig(str(tmp_path), bf16=False, moe_load_balance="window", **TRAIN_ARGS)
    trainer, windows, initial, start = train_and_collect(
        MoESFT,
        args,
        model=tiny_mixtral(),
        train_dataset=text_dataset(NUM_SAMPLES),
        processing_class=word_tokenizer(),
    )
    assert trainer.aux_loss_enabled  # TRL would add its own (divided) router term: the mode must replace it
    error = update_error(initial, trainer.model, sgd_reference(start, windows, large_batch_loss))
    # The default (micro_batch) mode in this composition: tests/test_composition.py::...sft_moe_router_aux_loss.
    print(f"SFTTrainer composition, window mode: relative update error {error:.2e}")
    assert error <= RTOL


@pytest.mark.slow
def test_ddp_exact_mode_matches_the_large_batch_over_all_ranks(tmp_path):
    """2 gloo processes, uneven items per rank: the window's expert counts are all-reduced, so every rank uses the
    routing statistics of the large batch over all ranks' samples."""
    from tests.multiprocess import launch

    launch(str(tmp_path), script="tests/workers/moe_ddp.py")
    records = [json.loads((tmp_path / f"moe_ddp_rank{r}.json").read_text()) for r in (0, 1)]
    for r in records:
        print(
            f"DDP rank {r['rank']}: relative update error window {r['window']:.2e}, micro_batch {r['micro_batch']:.2e}"
        )
        assert r["window"] <= RTOL
        assert r["micro_batch"] > 100 * r["window"]
        assert abs(r["window_aux"][0] - r["large_batch_aux"][0]) <= RTOL * r["large_batch_aux"][0]


def test_training_forwards_route_as_counted_with_router_jitter(start_and_windows):
    """With router jitter (random in train mode), the forward-only pass restores the torch RNG state, so the training
    forwards draw the same noise and route exactly as the window's counts say; without the restore they differ."""
    from hf_gradaccum.losses.moe import capture_router_logits

    model, windows = start_and_windows
    model = copy.deepcopy(model).train()
    model.config.router_jitter_noise = 0.5
    for module in model.modules():
        if hasattr(module, "jitter_noise"):
            module.jitter_noise = 0.5
    balance = WindowRouterBalance(model)
    window = windows[0]

    def training_counts():
        total = None
        for batch in window:
            with capture_router_logits(model) as logits:
                balance.micro_batch_loss(batch)
            counts = router_counts(logits, 4, 2, batch["attention_mask"])
            total = counts if total is None else total + counts
        return total.expert_counts

    balance.prepare_window(window)
    assert torch.equal(training_counts(), balance.window.expert_counts)
    balance.prepare_window(window)
    torch.manual_seed(12345)  # other noise than the counted pass drew: the routing no longer matches the counts
    assert not torch.equal(training_counts(), balance.window.expert_counts)


def test_window_mode_behind_another_trainer_is_refused(tmp_path):
    """The window mode replaces the router term in `compute_loss`: behind SFTTrainer in the class order, SFTTrainer's
    `compute_loss` would run first and add its own term, so the composition is refused with the order to use."""
    from trl import SFTTrainer

    from tests.composed_arguments import GradAccumSFTConfig

    class SFTFirst(SFTTrainer, GradAccumTrainer):
        pass

    args = GradAccumSFTConfig(str(tmp_path), bf16=False, moe_load_balance="window", **TRAIN_ARGS)
    with pytest.raises(ValueError, match=r"moe_load_balance='window' needs GradAccumTrainer before SFTTrainer"):
        SFTFirst(
            model=tiny_mixtral(), args=args, train_dataset=text_dataset(NUM_SAMPLES), processing_class=word_tokenizer()
        )
