"""BatchNorm under gradient accumulation: the one layer that breaks "N micro-batches == one large batch".

Every other layer treats samples independently, so the accumulated gradient is the large-batch gradient. A
BatchNorm layer in train mode normalises with the statistics of the batch it sees, i.e. of the *micro*-batch: the
forward pass itself differs, and no weighting of the gradients can repair that. There are three ways out, in order of
exactness:

- [`convert_batchnorm_to_groupnorm`]: GroupNorm normalises each sample on its own, so accumulation is exact. The
  model changes (from-scratch training, or fine-tuning that tolerates it).
- [`freeze_batchnorm`]: normalise with the running statistics and stop updating them (BatchNorm in eval mode, kept so
  when the trainer calls `model.train()`). Exact, and the standard choice when fine-tuning a pretrained CNN.
- [`apply_accumulation_bn_momentum`]: keep BatchNorm in train mode and only correct the running-statistics momentum
  so they decay per *optimizer* step as with the large batch. Not exact (micro-batch statistics are noisier); it only
  keeps the eval-time statistics on the large-batch time scale.

All functions follow timm's `freeze_batch_norm_2d` style: take a module, return a module (the replacement when the
module itself is a BatchNorm), recurse over children, and swap children in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.validation import check_positive_int

logger = logging.getLogger(__name__)

# `_BatchNorm` is the common base of BatchNorm1d/2d/3d, SyncBatchNorm and their Lazy variants (InstanceNorm is not
# one), so subclasses from other libraries are caught too.
_EXACT_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class BatchNormConversion(NamedTuple):
    """One BatchNorm layer replaced by [`convert_batchnorm_to_groupnorm`]."""

    name: str
    """Qualified name of the layer in the converted module (`""` for the top-level module itself)."""
    channels: int
    """`num_features` of the BatchNorm, i.e. `num_channels` of the GroupNorm."""
    groups: int
    """`num_groups` of the GroupNorm."""


def groupnorm_num_groups(channels: int, *, num_groups: int = 32, group_size: int | None = None) -> int:
    """
    The GroupNorm group count for `channels` channels: the largest divisor of `channels` that is `<= num_groups`, or
    `channels // group_size` when `group_size` is given (it must then divide `channels`).

    GroupNorm needs the group count to divide the channel count. Taking the largest such divisor keeps the layer as
    close as possible to the requested 32 groups of Wu & He (2018) without failing on odd widths (3, 24, 40, ...).

    Args:
        channels (`int`): number of channels, >= 1.
        num_groups (`int`, *optional*, defaults to 32): the largest group count allowed.
        group_size (`int`, *optional*): channels per group; overrides `num_groups` when given.

    Returns:
        `int`: the group count.

    Example:

    ```python
    >>> from hf_gradaccum.helpers.normalization import groupnorm_num_groups
    >>> [groupnorm_num_groups(c) for c in (24, 40, 3, 64)]
    [24, 20, 3, 32]
    >>> groupnorm_num_groups(64, group_size=16)
    4
    ```
    """
    check_positive_int(channels, "channels")
    if group_size is not None:
        check_positive_int(group_size, "group_size")
        if channels % group_size:
            raise ValueError(
                f"`group_size={group_size}` does not divide a layer's {channels} channels; use a `group_size` that "
                f"divides every BatchNorm's channel count, or pass `num_groups` instead."
            )
        return channels // group_size
    check_positive_int(num_groups, "num_groups")
    return max(g for g in range(1, min(num_groups, channels) + 1) if channels % g == 0)


def _check_replaceable(bn: _BatchNorm, name: str) -> None:
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(
            f"BatchNorm layer {name or '<root>'!r} is lazy and not initialised yet: run one forward first."
        )
    if type(bn) not in _EXACT_BATCHNORM_TYPES:
        # A subclass may fuse extra behaviour (e.g. timm's BatchNormAct2d adds an activation) that a plain
        # replacement drops; say so rather than silently changing the model.
        logger.warning(
            "Replacing %r of type %s: behaviour specific to the subclass is dropped.", name, type(bn).__name__
        )


def _replace_batchnorms(
    module: nn.Module,
    replace: Callable[[_BatchNorm, str], nn.Module],
    prefix: str = "",
    memo: dict[int, nn.Module] | None = None,
) -> nn.Module:
    """Return `replace(module, name)` if `module` is a BatchNorm, else swap its BatchNorm descendants in place."""
    memo = {} if memo is None else memo
    if isinstance(module, _BatchNorm):
        # A layer shared between two parents gets one replacement, so it stays shared.
        if id(module) not in memo:
            _check_replaceable(module, prefix)
            memo[id(module)] = replace(module, prefix)
        return memo[id(module)]
    # `_modules` rather than `named_children()`: the latter skips a child seen under another name, which would leave
    # the second use of a shared BatchNorm unconverted.
    for child_name, child in list(module._modules.items()):
        if child is None:
            continue
        new_child = _replace_batchnorms(child, replace, f"{prefix}.{child_name}" if prefix else child_name, memo)
        if new_child is not child:
            module.add_module(child_name, new_child)
    return module


def convert_batchnorm_to_groupnorm(
    module: nn.Module, *, num_groups: int = 32, group_size: int | None = None
) -> nn.Module:
    """
    Replace every BatchNorm (1d/2d/3d, SyncBatchNorm, recursively) with `nn.GroupNorm`, so that the model treats
    every sample independently and gradient accumulation is exactly large-batch training.

    Each GroupNorm gets [`groupnorm_num_groups`] groups, the BatchNorm's `eps`, and the BatchNorm's own affine
    `weight` and `bias` *Parameter objects* (same values, dtype, device and `requires_grad`; an optimizer or
    [`GradientAccumulator`] built before the conversion keeps working). Train/eval mode is kept. Running statistics
    are dropped: GroupNorm has none. Forward hooks registered on a BatchNorm are not carried over.

    The replaced layers are logged and listed in `module.batchnorm_conversions` (a list of [`BatchNormConversion`]
    `(name, channels, groups)` records) on the returned module.

    Note: GroupNorm normalises over the channels of a group *and* the positions after them. For `BatchNorm1d` fed
    `(batch, channels)` inputs (no length dimension) a group of one channel has nothing to normalise over; use fewer,
    larger groups (`group_size`) for such layers. A `from_pretrained` reload rebuilds BatchNorm from the config:
    convert again, then load the converted `state_dict` (GroupNorm keeps the `weight`/`bias` names).

    Args:
        module (`nn.Module`): the model or layer to convert, modified in place.
        num_groups (`int`, *optional*, defaults to 32): largest group count per layer.
        group_size (`int`, *optional*): channels per group instead; must divide every layer's channel count.

    Returns:
        `nn.Module`: `module` itself, or its replacement if `module` is a BatchNorm.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.helpers.normalization import convert_batchnorm_to_groupnorm
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 40, 3), torch.nn.BatchNorm2d(40), torch.nn.ReLU())
    >>> model = convert_batchnorm_to_groupnorm(model)
    >>> type(model[1]).__name__, model[1].num_groups
    ('GroupNorm', 20)
    >>> model.batchnorm_conversions
    [BatchNormConversion(name='1', channels=40, groups=20)]
    ```
    """
    # Validate the arguments once up front, so a bad value fails even on a model without BatchNorm.
    if group_size is not None:
        check_positive_int(group_size, "group_size")
    else:
        check_positive_int(num_groups, "num_groups")
    records: list[BatchNormConversion] = []

    def replace(bn: _BatchNorm, name: str) -> nn.GroupNorm:
        try:
            groups = groupnorm_num_groups(bn.num_features, num_groups=num_groups, group_size=group_size)
        except ValueError as error:
            raise ValueError(f"Cannot convert BatchNorm layer {name or '<root>'!r}: {error}") from error
        # Without affine parameters GroupNorm holds no tensor at all, so only the affine case needs device/dtype.
        factory = {"device": bn.weight.device, "dtype": bn.weight.dtype} if bn.affine else {}
        gn = nn.GroupNorm(groups, bn.num_features, eps=bn.eps, affine=bn.affine, **factory)
        if bn.affine:
            # Reuse the Parameter objects: the values are copied by construction, and anything that already holds
            # them (optimizer state, accumulator hooks, `requires_grad`, tied weights) stays valid.
            gn.weight, gn.bias = bn.weight, bn.bias
        gn.train(bn.training)
        records.append(BatchNormConversion(name, bn.num_features, groups))
        return gn

    converted = _replace_batchnorms(module, replace)
    if records:
        logger.info(
            "Converted %d BatchNorm layer(s) to GroupNorm: %s",
            len(records),
            ", ".join(f"{r.name or '<root>'} ({r.channels} ch -> {r.groups} groups)" for r in records),
        )
    else:
        logger.info("No BatchNorm layer to convert.")
    converted.batchnorm_conversions = records
    return converted


class FrozenBatchNorm(nn.Module):
    """
    BatchNorm that always normalises with its running statistics and never updates them, in train mode too.

    Unlike timm's `FrozenBatchNorm2d` the affine `weight` and `bias` stay `nn.Parameter`s (trainable unless their
    `requires_grad` is off): fine-tuning them is cheap and standard, and it does not break exactness because they act
    on each sample separately. It works for any input `(batch, channels, *)`, so it replaces BatchNorm1d/2d/3d alike.
    The `state_dict` keys are BatchNorm's, so BatchNorm checkpoints load into it and back.

    Args:
        batchnorm (`_BatchNorm`): the layer to freeze; its parameters and buffers are reused, not copied.
    """

    def __init__(self, batchnorm: _BatchNorm) -> None:
        super().__init__()
        if batchnorm.running_mean is None or batchnorm.running_var is None:
            raise ValueError(
                "Cannot freeze a BatchNorm with `track_running_stats=False`: it has no running statistics to "
                "normalise with. Convert it with `convert_batchnorm_to_groupnorm` instead."
            )
        self.num_features = batchnorm.num_features
        self.eps = batchnorm.eps
        self.affine = batchnorm.affine
        # `register_parameter` also accepts `None` (affine=False), keeping `weight`/`bias` attributes as BatchNorm does.
        self.register_parameter("weight", batchnorm.weight)
        self.register_parameter("bias", batchnorm.bias)
        self.register_buffer("running_mean", batchnorm.running_mean)
        self.register_buffer("running_var", batchnorm.running_var)
        if getattr(batchnorm, "num_batches_tracked", None) is not None:
            self.register_buffer("num_batches_tracked", batchnorm.num_batches_tracked)
        self.train(batchnorm.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `training=False` whatever `self.training` is: exactly BatchNorm's eval-mode forward, a per-channel affine map
        # of each sample, so micro-batches and the large batch see the same function.
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.affine}"


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """
    Replace every BatchNorm (recursively) with a [`FrozenBatchNorm`]: it normalises with its running statistics and
    stops updating them, even in train mode. Each layer is then a fixed per-sample affine map, so accumulated training
    equals large-batch training exactly.

    `model.eval()` alone is not enough, since trainers call `model.train()` at every step. The affine `weight` and
    `bias` stay trainable (the usual choice when fine-tuning a pretrained CNN); freeze them with
    `requires_grad_(False)` if wanted. The original Parameter and buffer objects are reused.

    Args:
        module (`nn.Module`): the model or layer, modified in place.

    Returns:
        `nn.Module`: `module` itself, or its replacement if `module` is a BatchNorm.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.helpers.normalization import freeze_batchnorm
    >>> model = freeze_batchnorm(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))).train()
    >>> before = model[1].running_mean.clone()
    >>> _ = model(torch.randn(4, 3, 8, 8))
    >>> torch.equal(model[1].running_mean, before)
    True
    ```
    """
    names: list[str] = []

    def replace(bn: _BatchNorm, name: str) -> FrozenBatchNorm:
        try:
            frozen = FrozenBatchNorm(bn)
        except ValueError as error:
            raise ValueError(f"BatchNorm layer {name or '<root>'!r}: {error}") from error
        names.append(name or "<root>")
        return frozen

    frozen_module = _replace_batchnorms(module, replace)
    logger.info("Froze %d BatchNorm layer(s)%s", len(names), f": {', '.join(names)}" if names else ".")
    return frozen_module


def accumulation_bn_momentum(momentum: float, steps: int) -> float:
    """
    The per-micro-batch BatchNorm momentum `1 - (1 - momentum) ** (1 / steps)`.

    A running statistic `r` updated once per micro-batch with momentum `m'` decays by `(1 - m')**steps` per optimizer
    step; with the large batch it decays by `1 - momentum`. Equating the two keeps the running statistics on the
    large-batch time scale (`m' ~= momentum / steps` for small momentum). The statistics themselves still come from
    micro-batches, so this corrects the averaging horizon, not the per-batch noise.

    Args:
        momentum (`float`): the large-batch momentum, in (0, 1] (PyTorch's default is 0.1).
        steps (`int`): micro-batches per optimizer step (`gradient_accumulation_steps`), >= 1.

    Returns:
        `float`: the momentum to use per micro-batch.

    Example:

    ```python
    >>> from hf_gradaccum.helpers.normalization import accumulation_bn_momentum
    >>> round(accumulation_bn_momentum(0.1, 4), 6)
    0.025996
    >>> accumulation_bn_momentum(0.1, 1)
    0.1
    ```
    """
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 < momentum <= 1:
        raise ValueError(
            f"`momentum` must be a number in (0, 1], got {momentum!r}. (`momentum=None`, the cumulative moving "
            "average, needs no correction.)"
        )
    check_positive_int(steps, "steps")
    if steps == 1:
        return float(momentum)  # skip the pow: no rounding when nothing changes
    return 1.0 - (1.0 - momentum) ** (1.0 / steps)


def apply_accumulation_bn_momentum(module: nn.Module, steps: int) -> nn.Module:
    """
    Set every BatchNorm's momentum to [`accumulation_bn_momentum`]`(momentum, steps)`, so running statistics decay per
    optimizer step as in large-batch training.

    Idempotent: the layer's original momentum is remembered (`_hf_gradaccum_base_momentum`), so calling again with a
    new `steps` (e.g. after the micro-batch was halved on OOM) recomputes from it instead of compounding. Layers with
    `momentum=None` (cumulative moving average over all batches) are left alone with a warning: the cumulative average
    weights every micro-batch equally, which is already the large-batch weighting up to the micro-batch noise.

    Args:
        module (`nn.Module`): the model, modified in place.
        steps (`int`): micro-batches per optimizer step (`gradient_accumulation_steps`), >= 1.

    Returns:
        `nn.Module`: `module`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.helpers.normalization import apply_accumulation_bn_momentum
    >>> model = apply_accumulation_bn_momentum(torch.nn.Sequential(torch.nn.BatchNorm1d(4)), steps=4)
    >>> round(model[0].momentum, 6)
    0.025996
    >>> round(apply_accumulation_bn_momentum(model, steps=1)[0].momentum, 6)
    0.1
    ```
    """
    check_positive_int(steps, "steps")
    changed = 0
    for name, bn in module.named_modules():
        if not isinstance(bn, _BatchNorm):
            continue
        base = getattr(bn, "_hf_gradaccum_base_momentum", bn.momentum)
        if base is None:
            logger.warning(
                "BatchNorm %r uses momentum=None (cumulative average); left unchanged by the accumulation correction.",
                name or "<root>",
            )
            continue
        bn._hf_gradaccum_base_momentum = base
        bn.momentum = accumulation_bn_momentum(base, steps)
        changed += 1
    logger.info("Set the BatchNorm momentum of %d layer(s) for %d accumulation steps.", changed, steps)
    return module
