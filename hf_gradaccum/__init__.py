"""hf_gradaccum: gradient accumulation that is exactly the large-batch update, for transformers and accelerate.

The package has four parts; each may import only the ones listed before it (`tests/test_layout.py` checks this):

- `engine/`: the accumulation itself (buffers, item weighting, windows, fp16 loss scaling, distributed reduction,
  item counting, out-of-memory recovery). torch and accelerate only; no transformers.
- `helpers/`: batch-size helpers (BatchNorm treatments, learning-rate scaling, micro-batch planning).
- `adapters/`: `GradAccumTrainer` and `GradAccumArguments`, thin transformers adapters over the engine.
- `assets.py` (offline model/data files the CLI defaults to) and `cli.py` (`hf-gradaccum verify`) sit beside them.

The recipes' parity experiment harness lives outside the package, in `recipes/harness/`.

Public names are imported lazily, so `import hf_gradaccum` costs nothing until a name is used, and never imports
matplotlib.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    "GradientAccumulator": ".engine.accumulator",
    "AccumulatorCheckpoint": ".engine.sharded_checkpoint",
    "WindowResult": ".engine.window",
    "DynamicLossScaler": ".engine.loss_scaling",
    "count_items": ".engine.items",
    "count_items_in_batch": ".engine.items",
    "GradAccumArguments": ".adapters.arguments",
    "GradAccumFields": ".adapters.arguments",
    "GradAccumSeq2SeqArguments": ".adapters.arguments",
    "with_gradaccum_fields": ".adapters.arguments",
    "GradAccumTrainer": ".adapters.trainer",
    "make_gradaccum_trainer": ".adapters.trainer",
    "GradAccumSFTConfig": ".adapters.trl_support",
    "GradAccumMoETrainer": ".adapters.moe",
    "MoEWindowBalanceMixin": ".adapters.moe",
    "WindowRouterBalance": ".adapters.moe",
    "GradAccumDPOConfig": ".adapters.trl_support",
    "GradAccumRewardConfig": ".adapters.trl_support",
    "effective_batch_size": ".helpers.lr_scaling",
    "lr_scaling_factor": ".helpers.lr_scaling",
    "SplitInvarianceResult": ".verification",
    "verify_split_invariance": ".verification",
    "recommended_warmup_steps": ".helpers.lr_scaling",
    "scale_learning_rate": ".helpers.lr_scaling",
    "BatchNormConversion": ".helpers.normalization",
    "FrozenBatchNorm": ".helpers.normalization",
    "accumulation_bn_momentum": ".helpers.normalization",
    "apply_accumulation_bn_momentum": ".helpers.normalization",
    "convert_batchnorm_to_groupnorm": ".helpers.normalization",
    "freeze_batchnorm": ".helpers.normalization",
    "groupnorm_num_groups": ".helpers.normalization",
    "AccumulationPlan": ".helpers.planning",
    "CannotShrinkMicroBatchError": ".helpers.planning",
    "plan_accumulation": ".helpers.planning",
    # losses that couple the batch (in-batch negatives): gradient caching, docs/coupled_losses.md
    "CoupledLoss": ".engine.coupled",
    "CoupledLossTrainer": ".adapters.coupled",
    "clip_coupled_loss": ".adapters.coupled",
    "ranking_coupled_loss": ".adapters.coupled",
}

__all__ = [
    "AccumulationPlan",
    "AccumulatorCheckpoint",
    "BatchNormConversion",
    "CannotShrinkMicroBatchError",
    "CoupledLoss",
    "CoupledLossTrainer",
    "DynamicLossScaler",
    "FrozenBatchNorm",
    "GradAccumArguments",
    "GradAccumDPOConfig",
    "GradAccumFields",
    "GradAccumMoETrainer",
    "GradAccumRewardConfig",
    "GradAccumSFTConfig",
    "GradAccumSeq2SeqArguments",
    "GradAccumTrainer",
    "GradientAccumulator",
    "MoEWindowBalanceMixin",
    "SplitInvarianceResult",
    "WindowResult",
    "WindowRouterBalance",
    "accumulation_bn_momentum",
    "apply_accumulation_bn_momentum",
    "clip_coupled_loss",
    "convert_batchnorm_to_groupnorm",
    "count_items",
    "count_items_in_batch",
    "effective_batch_size",
    "freeze_batchnorm",
    "groupnorm_num_groups",
    "lr_scaling_factor",
    "make_gradaccum_trainer",
    "plan_accumulation",
    "ranking_coupled_loss",
    "recommended_warmup_steps",
    "scale_learning_rate",
    "verify_split_invariance",
    "with_gradaccum_fields",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # static type checkers and IDEs see the real names
    from .adapters.arguments import (
        GradAccumArguments,
        GradAccumFields,
        GradAccumSeq2SeqArguments,
        with_gradaccum_fields,
    )
    from .adapters.moe import GradAccumMoETrainer, MoEWindowBalanceMixin, WindowRouterBalance
    from .adapters.trainer import GradAccumTrainer, make_gradaccum_trainer
    from .adapters.trl_support import GradAccumDPOConfig, GradAccumRewardConfig, GradAccumSFTConfig
    from .engine.accumulator import GradientAccumulator
    from .engine.items import count_items, count_items_in_batch
    from .engine.loss_scaling import DynamicLossScaler
    from .engine.sharded_checkpoint import AccumulatorCheckpoint
    from .engine.window import WindowResult
    from .helpers.lr_scaling import (
        effective_batch_size,
        lr_scaling_factor,
        recommended_warmup_steps,
        scale_learning_rate,
    )
    from .helpers.normalization import (
        BatchNormConversion,
        FrozenBatchNorm,
        accumulation_bn_momentum,
        apply_accumulation_bn_momentum,
        convert_batchnorm_to_groupnorm,
        freeze_batchnorm,
        groupnorm_num_groups,
    )
    from .helpers.planning import AccumulationPlan, CannotShrinkMicroBatchError, plan_accumulation
    from .verification import SplitInvarianceResult, verify_split_invariance
