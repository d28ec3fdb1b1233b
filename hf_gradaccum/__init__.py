"""hf_gradaccum: gradient accumulation that is exactly the large-batch update, for transformers and accelerate.

The package has four parts; each may import only the ones listed before it (`tests/test_layout.py` checks this):

- `engine/`: the accumulation itself (buffers, item weighting, windows, fp16 loss scaling, distributed reduction,
  item counting, the out-of-memory window retry). torch and accelerate only; no transformers.
- `helpers/`: batch-size helpers (BatchNorm treatments, learning-rate scaling, micro-batch planning).
- `adapters/`: `GradAccumTrainer` and `GradAccumArguments`, thin transformers adapters over the engine.
- `verification`: the split-invariance exactness check.
- `assets.py` (offline model/data files the CLI defaults to) and `cli.py` (`hf-gradaccum verify`) sit beside them.

The recipes' parity experiment harness lives outside the package, in `recipes/harness/`.

Public names are imported lazily, so `import hf_gradaccum` costs nothing until a name is used. One way to do each
thing: `GradAccumTrainer` (compose with another trainer by subclassing, `class T(GradAccumTrainer, SFTTrainer)`;
a loss over the whole window as its `coupled_loss=`; exact MoE balancing as `moe_load_balance="window"`),
`GradAccumArguments` (or the `GradAccumFields` mixin on another arguments class, e.g. TRL's `SFTConfig`), and
`GradientAccumulator` for plain loops.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    # plain loops (engine)
    "GradientAccumulator": ".adapters.plain_loop_rule",
    "WindowResult": ".engine.window",
    "DynamicLossScaler": ".engine.loss_scaling",
    "AccumulatorCheckpoint": ".engine.fsdp2.checkpoint",
    "count_items_in_batch": ".engine.items",
    "count_items_in_batches": ".engine.items",
    "WindowOOMRetry": ".engine.oom_retry",
    "RunBatchSampler": ".engine.run_batch_sampler",
    # transformers
    "GradAccumTrainer": ".adapters.trainer",
    "GradAccumArguments": ".adapters.arguments",
    "GradAccumFields": ".adapters.arguments",
    # losses that couple the batch (in-batch negatives): gradient caching, docs/coupled_losses.md
    "CoupledLoss": ".engine.coupled",
    "clip_coupled_loss": ".adapters.coupled",
    "ranking_coupled_loss": ".adapters.coupled",
    # exact window-level MoE load balancing, docs/moe_balance.md
    "WindowRouterBalance": ".adapters.moe",
    # exactness check
    "verify_split_invariance": ".verification",
    "SplitInvarianceResult": ".verification",
    "AccumulationNotExactError": ".adapters.accumulation_check",
    # batch-size helpers
    "plan_accumulation": ".helpers.planning",
    "AccumulationPlan": ".helpers.planning",
    "CannotShrinkMicroBatchError": ".helpers.planning",
    "scale_learning_rate": ".helpers.lr_scaling",
    "EffectiveBatchCallback": ".adapters.effective_batch",
    "apply_accumulation_bn_momentum": ".helpers.normalization",
    "convert_batchnorm_to_groupnorm": ".helpers.normalization",
    "freeze_batchnorm": ".helpers.normalization",
}

__all__ = [
    "AccumulationNotExactError",
    "AccumulationPlan",
    "AccumulatorCheckpoint",
    "CannotShrinkMicroBatchError",
    "CoupledLoss",
    "DynamicLossScaler",
    "EffectiveBatchCallback",
    "GradAccumArguments",
    "GradAccumFields",
    "GradAccumTrainer",
    "GradientAccumulator",
    "RunBatchSampler",
    "SplitInvarianceResult",
    "WindowOOMRetry",
    "WindowResult",
    "WindowRouterBalance",
    "apply_accumulation_bn_momentum",
    "clip_coupled_loss",
    "convert_batchnorm_to_groupnorm",
    "count_items_in_batch",
    "count_items_in_batches",
    "freeze_batchnorm",
    "plan_accumulation",
    "ranking_coupled_loss",
    "scale_learning_rate",
    "verify_split_invariance",
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
    from .adapters.accumulation_check import AccumulationNotExactError
    from .adapters.arguments import GradAccumArguments, GradAccumFields
    from .adapters.coupled import clip_coupled_loss, ranking_coupled_loss
    from .adapters.effective_batch import EffectiveBatchCallback
    from .adapters.moe import WindowRouterBalance
    from .adapters.plain_loop_rule import GradientAccumulator
    from .adapters.trainer import GradAccumTrainer
    from .engine.coupled import CoupledLoss
    from .engine.fsdp2.checkpoint import AccumulatorCheckpoint
    from .engine.items import count_items_in_batch, count_items_in_batches
    from .engine.loss_scaling import DynamicLossScaler
    from .engine.oom_retry import WindowOOMRetry
    from .engine.run_batch_sampler import RunBatchSampler
    from .engine.window import WindowResult
    from .helpers.lr_scaling import scale_learning_rate
    from .helpers.normalization import (
        apply_accumulation_bn_momentum,
        convert_batchnorm_to_groupnorm,
        freeze_batchnorm,
    )
    from .helpers.planning import AccumulationPlan, CannotShrinkMicroBatchError, plan_accumulation
    from .verification import SplitInvarianceResult, verify_split_invariance
