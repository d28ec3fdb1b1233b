"""BatchNorm helpers: conversion to GroupNorm, freezing, and the accumulation momentum correction.

The parity tests run one SGD(lr=1) step of a tiny random-init `transformers` ResNet on 16 images, once as one large
batch and once as 4 micro-batches of 4 through `GradientAccumulator`, and compare the weight updates.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification

from hf_gradaccum.engine.accumulator import GradientAccumulator
from hf_gradaccum.helpers.normalization import (
    BatchNormConversion,
    FrozenBatchNorm,
    accumulation_bn_momentum,
    apply_accumulation_bn_momentum,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
    groupnorm_num_groups,
)

# fp32 updates of ~5k parameters that differ only in summation order agree to ~1e-7 relative; 1e-5 leaves margin
# while being far below the BatchNorm gap (> 1e-3).
PARITY_TOLERANCE = 1e-5
BN_GAP_THRESHOLD = 1e-3
BATCH, STEPS = 16, 4

BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.modules.batchnorm._BatchNorm)


def tiny_resnet(seed: int = 0) -> ResNetForImageClassification:
    torch.manual_seed(seed)
    config = ResNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10
    )
    return ResNetForImageClassification(config).float()


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # A non-zero mean and a scale per image, so batch statistics really differ between micro-batches.
    images = torch.randn(BATCH, 1, 28, 28, generator=generator) * torch.rand(BATCH, 1, 1, 1, generator=generator) * 3
    return images + 0.5, torch.randint(0, 10, (BATCH,), generator=generator)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def large_batch_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, lr: float = 1.0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model(pixel_values=images, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def accumulated_step(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, lr: float = 1.0, accumulator=None
) -> GradientAccumulator:
    accumulator = accumulator or GradientAccumulator(model, gradient_accumulation_steps=STEPS)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in zip(images.chunk(STEPS), labels.chunk(STEPS), strict=True):
        accumulator.backward(model(pixel_values=x, labels=y).loss, num_items=len(y))
    result = accumulator.step(optimizer)
    assert result.applied and result.micro_steps == STEPS
    return accumulator


def relative_update_error(model: nn.Module, seed: int = 1) -> float:
    """||dW_accumulated - dW_large|| / ||dW_large|| after one SGD(lr=1) step from the same weights on the same data."""
    images, labels = make_batch(seed)
    reference, accumulated = copy.deepcopy(model), copy.deepcopy(model)
    before = flat_params(model)
    large_batch_step(reference, images, labels)
    accumulated_step(accumulated, images, labels)
    d_ref = flat_params(reference) - before
    d_acc = flat_params(accumulated) - before
    assert d_ref.norm() > 0
    return float((d_acc - d_ref).norm() / d_ref.norm())


def batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, BATCHNORM_TYPES)]


def running_stats(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            torch.cat([m.running_mean.double(), m.running_var.double()])
            for m in model.modules()
            if hasattr(m, "running_var")
        ]
    )


def randomize_affine(model: nn.Module) -> None:
    # Non-default values, so "copied" cannot pass by accident with ones and zeros.
    with torch.no_grad():
        for m in batchnorms(model):
            if m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


# ---------------------------------------------------------------------------------------------- group counts
@pytest.mark.parametrize(
    ("channels", "num_groups", "expected"),
    [(24, 32, 24), (40, 32, 20), (3, 32, 3), (64, 32, 32), (40, 8, 8), (3, 2, 1), (7, 32, 7), (96, 32, 32)],
)
def test_group_count_is_largest_divisor(channels, num_groups, expected):
    groups = groupnorm_num_groups(channels, num_groups=num_groups)
    assert groups == expected
    assert channels % groups == 0


def test_group_size_and_invalid_arguments():
    assert groupnorm_num_groups(64, group_size=16) == 4
    assert groupnorm_num_groups(40, group_size=40) == 1
    with pytest.raises(ValueError, match="group_size"):
        groupnorm_num_groups(40, group_size=7)
    with pytest.raises(ValueError, match="num_groups"):
        groupnorm_num_groups(40, num_groups=0)
    with pytest.raises(ValueError, match="group_size"):
        convert_batchnorm_to_groupnorm(nn.Sequential(nn.BatchNorm2d(40)), group_size=7)
    with pytest.raises(ValueError, match="num_groups"):
        convert_batchnorm_to_groupnorm(nn.Linear(2, 2), num_groups=-1)


# ---------------------------------------------------------------------------------------------- conversion
def hand_made_model() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            bn1d=nn.BatchNorm1d(24, eps=1e-3),
            block=nn.Sequential(nn.BatchNorm2d(40), nn.ModuleList([nn.BatchNorm3d(3)])),
            sync=nn.SyncBatchNorm(64),
        )
    )


def test_convert_hand_made_model():
    torch.manual_seed(0)
    model = hand_made_model()
    randomize_affine(model)
    originals = {name: m for name, m in model.named_modules() if isinstance(m, BATCHNORM_TYPES)}

    converted = convert_batchnorm_to_groupnorm(model)

    assert converted is model
    assert batchnorms(model) == []
    assert model.batchnorm_conversions == [
        BatchNormConversion("bn1d", 24, 24),
        BatchNormConversion("block.0", 40, 20),
        BatchNormConversion("block.1.0", 3, 3),
        BatchNormConversion("sync", 64, 32),
    ]
    inputs = {"bn1d": (2, 24, 5), "block.0": (2, 40, 3, 3), "block.1.0": (2, 3, 2, 2, 2), "sync": (2, 64, 4, 4)}
    modules = dict(model.named_modules())
    for name, bn in originals.items():
        gn = modules[name]
        assert isinstance(gn, nn.GroupNorm) and gn.num_channels % gn.num_groups == 0
        assert gn.eps == bn.eps
        assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
        # The Parameter objects themselves are reused, so optimizers built before the conversion stay valid.
        assert gn.weight is bn.weight and gn.bias is bn.bias
        x = torch.randn(inputs[name])
        out = gn(x)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, nn.functional.group_norm(x, gn.num_groups, bn.weight, bn.bias, bn.eps))


def test_convert_resnet_keeps_mode_dtype_and_requires_grad():
    model = tiny_resnet().double()
    assert len(batchnorms(model)) == 6
    stem = model.resnet.embedder.embedder.normalization
    stem.weight.requires_grad_(False)
    model.train()
    model.resnet.encoder.stages[1].eval()  # a mixed-mode model: each layer keeps its own mode

    convert_batchnorm_to_groupnorm(model, num_groups=4)

    assert batchnorms(model) == []
    records = model.batchnorm_conversions
    assert [(r.channels, r.groups) for r in records] == [(8, 4)] * 3 + [(16, 4)] * 3
    assert {r.name for r in records} == {n for n, m in model.named_modules() if isinstance(m, nn.GroupNorm)}
    for name, gn in model.named_modules():
        if isinstance(gn, nn.GroupNorm):
            assert gn.weight.dtype == gn.bias.dtype == torch.float64
            assert gn.weight.device == torch.device("cpu")
            assert gn.training == (not name.startswith("resnet.encoder.stages.1"))
    assert model.resnet.embedder.embedder.normalization.weight.requires_grad is False
    assert model.resnet.embedder.embedder.normalization.bias.requires_grad is True
    logits = model(pixel_values=torch.randn(2, 1, 28, 28, dtype=torch.float64)).logits
    assert logits.dtype == torch.float64 and logits.shape == (2, 10) and torch.isfinite(logits).all()


def test_convert_top_level_shared_meta_and_non_affine(caplog):
    with caplog.at_level(logging.INFO, logger="hf_gradaccum.helpers.normalization"):
        gn = convert_batchnorm_to_groupnorm(nn.BatchNorm2d(64).eval())
    assert isinstance(gn, nn.GroupNorm) and not gn.training
    assert gn.batchnorm_conversions == [BatchNormConversion("", 64, 32)]
    assert "64 ch -> 32 groups" in caplog.text

    shared = nn.BatchNorm1d(6)
    model = convert_batchnorm_to_groupnorm(nn.Sequential(shared, nn.ReLU(), shared))
    assert model[0] is model[2] and isinstance(model[0], nn.GroupNorm)

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 12, 1), nn.BatchNorm2d(12))
    convert_batchnorm_to_groupnorm(model)
    assert model[1].weight.device.type == "meta"

    plain = convert_batchnorm_to_groupnorm(nn.Sequential(nn.BatchNorm2d(6, affine=False)))
    assert plain[0].weight is None and not plain[0].affine


def test_subclasses_warn_and_lazy_layers_are_refused(caplog):
    class BatchNormAct(nn.BatchNorm2d):  # stands in for e.g. timm's BatchNormAct2d, which adds an activation
        def forward(self, x):
            return torch.relu(super().forward(x))

    with caplog.at_level(logging.WARNING, logger="hf_gradaccum.helpers.normalization"):
        model = convert_batchnorm_to_groupnorm(nn.Sequential(BatchNormAct(8)))
    assert isinstance(model[0], nn.GroupNorm) and "BatchNormAct" in caplog.text
    with pytest.raises(ValueError, match="lazy"):
        convert_batchnorm_to_groupnorm(nn.Sequential(nn.LazyBatchNorm2d()))
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    lazy(torch.randn(2, 6, 3, 3))  # initialised: it is a BatchNorm2d now
    assert isinstance(freeze_batchnorm(lazy)[0], FrozenBatchNorm)


def test_converted_resnet_matches_large_batch():
    model = convert_batchnorm_to_groupnorm(tiny_resnet())
    error = relative_update_error(model)
    print(f"GroupNorm ResNet: relative update error {error:.3e} (tolerance {PARITY_TOLERANCE:g})")
    assert error <= PARITY_TOLERANCE


# ---------------------------------------------------------------------------------------------- freezing
def test_frozen_resnet_matches_large_batch_and_keeps_running_stats():
    model = tiny_resnet()
    # Give the running statistics non-trivial values first, as a pretrained checkpoint would have.
    model.train()
    with torch.no_grad():
        for seed in range(3):
            model(pixel_values=make_batch(100 + seed)[0])
    model = freeze_batchnorm(model).train()
    assert batchnorms(model) == [] and len([m for m in model.modules() if isinstance(m, FrozenBatchNorm)]) == 6
    stats_before = running_stats(model)

    error = relative_update_error(model)
    print(f"Frozen-BN ResNet: relative update error {error:.3e} (tolerance {PARITY_TOLERANCE:g})")
    assert error <= PARITY_TOLERANCE

    images, labels = make_batch(2)
    accumulated_step(model, images, labels)
    assert model.training
    assert torch.equal(running_stats(model), stats_before)  # bitwise: the statistics are never written


def test_frozen_batchnorm_is_batchnorm_in_eval_mode():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(5, eps=1e-3)
    randomize_affine(bn)
    bn(torch.randn(8, 5, 4, 4) * 2 + 1)  # fill the running statistics
    reference = copy.deepcopy(bn).eval()
    state = copy.deepcopy(bn.state_dict())

    frozen = freeze_batchnorm(bn).train()
    assert isinstance(frozen, FrozenBatchNorm) and frozen.weight is bn.weight and frozen.weight.requires_grad
    x = torch.randn(3, 5, 4, 4)
    torch.testing.assert_close(frozen(x), reference(x), rtol=0, atol=0)
    # Same state_dict keys as BatchNorm: checkpoints load both ways.
    assert frozen.state_dict().keys() == state.keys()
    frozen.load_state_dict(state, strict=True)
    # Any input rank works, as for BatchNorm1d/3d.
    assert freeze_batchnorm(nn.BatchNorm1d(5))(torch.randn(2, 5)).shape == (2, 5)

    with pytest.raises(ValueError, match=r"'1'.*track_running_stats"):
        freeze_batchnorm(nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3, track_running_stats=False)))


# ---------------------------------------------------------------------------------------------- plain BatchNorm
def test_plain_batchnorm_does_not_match_large_batch():
    error = relative_update_error(tiny_resnet())
    print(f"BatchNorm ResNet (train mode): relative update error {error:.3e} (must exceed {BN_GAP_THRESHOLD:g})")
    assert error > BN_GAP_THRESHOLD


def test_momentum_correction_tracks_large_batch_running_stats():
    windows, lr = 5, 0.1
    large = tiny_resnet().train()
    uncorrected = copy.deepcopy(large)
    corrected = apply_accumulation_bn_momentum(copy.deepcopy(large), STEPS)
    acc_uncorrected = GradientAccumulator(uncorrected, gradient_accumulation_steps=STEPS)
    acc_corrected = GradientAccumulator(corrected, gradient_accumulation_steps=STEPS)
    for window in range(windows):
        images, labels = make_batch(10 + window)
        large_batch_step(large, images, labels, lr=lr)
        accumulated_step(uncorrected, images, labels, lr=lr, accumulator=acc_uncorrected)
        accumulated_step(corrected, images, labels, lr=lr, accumulator=acc_corrected)
    target = running_stats(large)
    distance_uncorrected = float((running_stats(uncorrected) - target).norm())
    distance_corrected = float((running_stats(corrected) - target).norm())
    print(
        f"Running-stat distance to the large-batch run after {windows} windows: "
        f"uncorrected {distance_uncorrected:.4f}, corrected {distance_corrected:.4f}"
    )
    assert distance_corrected < distance_uncorrected


def test_accumulation_bn_momentum_values_and_validation():
    assert accumulation_bn_momentum(0.1, 1) == 0.1
    assert accumulation_bn_momentum(1.0, 8) == 1.0
    m = accumulation_bn_momentum(0.1, 4)
    assert math.isclose((1 - m) ** 4, 0.9, rel_tol=1e-12)
    assert math.isclose(m, 1 - 0.9**0.25, rel_tol=1e-15)
    for bad in (0, 0.0, -0.1, 1.5, None, True, "0.1"):
        with pytest.raises(ValueError, match=r"`momentum` must be a number in \(0, 1\]"):
            accumulation_bn_momentum(bad, 4)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="`steps` must be an integer >= 1"):
            accumulation_bn_momentum(0.1, bad)


def test_apply_accumulation_bn_momentum_is_idempotent_and_skips_cumulative(caplog):
    model = nn.Sequential(nn.BatchNorm2d(4, momentum=0.2), nn.BatchNorm1d(4, momentum=None))
    apply_accumulation_bn_momentum(model, 4)
    assert math.isclose(model[0].momentum, 1 - 0.8**0.25)
    apply_accumulation_bn_momentum(model, 8)  # e.g. after an OOM halved the micro-batch: not compounded
    assert math.isclose(model[0].momentum, 1 - 0.8**0.125)
    with caplog.at_level(logging.WARNING, logger="hf_gradaccum.helpers.normalization"):
        apply_accumulation_bn_momentum(model, 1)
    assert model[0].momentum == 0.2 and model[1].momentum is None
    assert "momentum=None" in caplog.text
    with pytest.raises(ValueError, match="steps"):
        apply_accumulation_bn_momentum(model, 0)
