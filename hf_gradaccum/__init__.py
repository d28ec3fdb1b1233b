"""hf_gradaccum: gradient accumulation that is exactly the large-batch update, for transformers and accelerate.

The package is laid out in floors, each a folder that imports only the floors below it (docs/architecture.md;
`tests/test_layout.py` checks it):

- `engine/`: the accumulation itself in plain PyTorch (buffers, item weighting, windows, fp16 loss scaling,
  distributed reduction, sharded buffers, the window losses, the run's batch). No transformers;
- `helpers/` (BatchNorm, learning rate, planning), `verification/` (the split-invariance check), `diagnostics/`;
- `config/`: `GradAccumArguments` and `GradAccumFields`, and the transformers releases they run on;
- `distributed/`: DeepSpeed, FSDP2, TP/HSDP and the run's batch as the Trainer sets them up;
- `losses/`: what a loss divides by, measured on the first window, and `GradientAccumulator` for plain loops;
- `integrations/`: TRL's and sentence-transformers' trainers, reached through `integrations/registry.py`;
- `trainer/`: `GradAccumTrainer`, a thin adapter over all of the above;
- `assets.py`, `versions.py`, `input_checks.py` and `cli.py` (`hf-gradaccum`) sit beside them.

The recipes' parity experiment harness lives outside the package, in `recipes/harness/`.

Public names are imported lazily, so `import hf_gradaccum` costs nothing until a name is used. One way to do each
thing: `GradAccumTrainer` (compose with another trainer by subclassing, `class T(GradAccumTrainer, SFTTrainer)`;
a loss over the whole window as its `coupled_loss=`; exact MoE balancing as `moe_load_balance="window"`),
`GradAccumArguments` (or the `GradAccumFields` mixin on another arguments class, e.g. TRL's `SFTConfig`), and
`GradientAccumulator` for plain loops.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    # plain loops (engine)
    "GradientAccumulator": ".losses.plain_loop",
    "WindowResult": ".engine.window",
    "DynamicLossScaler": ".engine.loss_scaling",
    "AccumulatorCheckpoint": ".engine.sharded.fsdp2_checkpoint",
    "count_items_in_batch": ".engine.items",
    "count_items_in_batches": ".engine.items",
    "WindowOOMRetry": ".engine.oom_retry",
    "RunBatchSampler": ".engine.run_batch.sampler",
    # transformers
    "GradAccumTrainer": ".trainer.trainer",
    "GradAccumArguments": ".config.arguments",
    "GradAccumFields": ".config.arguments",
    # losses that couple the batch (in-batch negatives): gradient caching, docs/coupled_losses.md
    "CoupledLoss": ".engine.window_losses.coupled",
    "clip_coupled_loss": ".losses.coupled",
    "ranking_coupled_loss": ".losses.coupled",
    # exact window-level MoE load balancing, docs/moe_balance.md
    "WindowRouterBalance": ".losses.moe",
    # a user's loss of several terms, each a mean over its own count, docs/model_losses.md
    "mean_terms": ".losses.declared_terms",
    # exactness check
    "verify_split_invariance": ".verification",
    "SplitInvarianceResult": ".verification",
    "AccumulationNotExactError": ".losses.accumulation_check",
    # batch-size helpers
    "plan_accumulation": ".helpers.planning",
    "AccumulationPlan": ".helpers.planning",
    "CannotShrinkMicroBatchError": ".helpers.planning",
    "scale_learning_rate": ".helpers.lr_scaling",
    "EffectiveBatchCallback": ".trainer.effective_batch",
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
    "mean_terms",
    "plan_accumulation",
    "ranking_coupled_loss",
    "scale_learning_rate",
    "verify_split_invariance",
]


# Modules that moved when the package was laid out in floors (docs/architecture.md): an old path still imports, as a
# module whose names are those of the modules it moved to, so that pickles keep loading (a checkpoint's
# `training_args.bin` names `GradAccumArguments` by `hf_gradaccum.adapters.arguments`) and so does code written against
# the old layout, with a warning. The new modules keep their own names, specs and loaders; old package paths have no
# search path, so nothing under them is ever loaded twice.
_MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "adapters": ("trainer",),
    "adapters.accumulation_check": ("losses.accumulation_check",),
    "adapters.arguments": ("config.arguments",),
    "adapters.atomic_checkpoints": ("trainer.atomic_checkpoints",),
    "adapters.compat": ("config.compat",),
    "adapters.composed_class": ("losses.composed_class",),
    "adapters.composition_error": ("losses.composition_error",),
    "adapters.compositions": (
        "integrations.registry",
        "integrations.sentence_transformers.loss_classes",
    ),
    "adapters.coupled": ("losses.coupled",),
    "adapters.deepspeed": ("distributed.deepspeed",),
    "adapters.effective_batch": ("trainer.effective_batch",),
    "adapters.loss_counting": ("losses.counting",),
    "adapters.loss_handover": ("trainer.loss_handover",),
    "adapters.loss_rule": ("losses.rule",),
    "adapters.model_inspection": ("losses.model_inspection",),
    "adapters.model_losses": ("losses.model_losses",),
    "adapters.moe": ("losses.moe",),
    "adapters.parallelism": ("distributed.parallelism",),
    "adapters.plain_loop_rule": ("losses.plain_loop",),
    "adapters.probe_gradients": ("losses.probe_gradients",),
    "adapters.run_batch": (
        "distributed.run_batch",
        "config.run_batch_arguments",
    ),
    "adapters.sentence_transformers": (
        "integrations.sentence_transformers.routing",
        "integrations.sentence_transformers.embedding_losses",
        "integrations.sentence_transformers.routes",
        "integrations.sentence_transformers.forward_replay",
        "integrations.sentence_transformers.loss_classes",
    ),
    "adapters.sharding": ("distributed.sharding",),
    "adapters.step_gating": ("trainer.step_gating",),
    "adapters.trainer": (
        "trainer.trainer",
        "trainer.accumulator_state",
    ),
    "adapters.training_checks": ("config.training_checks",),
    "adapters.trl_dpo_sorted": ("integrations.trl.dpo_sorted",),
    "adapters.trl_generating": ("integrations.trl.generating",),
    "adapters.trl_grpo": ("integrations.trl.grpo",),
    "adapters.trl_grpo_entropy": ("integrations.trl.grpo_entropy",),
    "adapters.trl_kto": ("integrations.trl.kto",),
    "adapters.trl_loss_terms": ("integrations.trl.loss_terms",),
    "adapters.window_end": ("trainer.window_end",),
    "engine.coupled": ("engine.window_losses.coupled",),
    "engine.fsdp2": ("engine.sharded",),
    "engine.fsdp2.buffers": (
        "engine.sharded.fsdp2_buffers",
        "engine.sharded.buffer_choice",
    ),
    "engine.fsdp2.checkpoint": ("engine.sharded.fsdp2_checkpoint",),
    "engine.fsdp2.schedule": ("engine.sharded.fsdp2_schedule",),
    "engine.grouped_coupled": ("engine.window_losses.grouped_coupled",),
    "engine.moe_balance": ("engine.window_losses.moe_balance",),
    "engine.run_batch_sampler": ("engine.run_batch.sampler",),
    "engine.tensor_parallel": ("engine.sharded.tensor_parallel",),
}


class _MovedModule(types.ModuleType):
    """An old module path: each name is looked up in the modules it moved to, in order."""

    __moved_to__: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        # Module attributes (`__file__`, `__path__`, ...) are this module's own, never the new modules'.
        for new in () if name.startswith("__") else self.__moved_to__:
            module = importlib.import_module(f"{__name__}.{new}")
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (moved to {self.__moved_to__}) has no attribute {name!r}")


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old path of a moved module and loads a [`_MovedModule`] for it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.removeprefix(__name__ + ".") not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> types.ModuleType:
        moved_to = _MOVED_MODULES[spec.name.removeprefix(__name__ + ".")]
        new = ", ".join(f"`{__name__}.{name}`" for name in moved_to)
        warnings.warn(f"`{spec.name}` moved to {new}; import it from there.", FutureWarning, stacklevel=2)
        module = _MovedModule(spec.name)
        module.__moved_to__ = moved_to
        module.__path__ = []  # a package for the submodules this finder maps, and for nothing else
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing runs: the names are read from the new modules when asked for."""


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    # First, ahead of the path finder: an old path is never looked up on disk.
    sys.meta_path.insert(0, _MovedModuleFinder())


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
    from .config.arguments import GradAccumArguments, GradAccumFields
    from .engine.items import count_items_in_batch, count_items_in_batches
    from .engine.loss_scaling import DynamicLossScaler
    from .engine.oom_retry import WindowOOMRetry
    from .engine.run_batch.sampler import RunBatchSampler
    from .engine.sharded.fsdp2_checkpoint import AccumulatorCheckpoint
    from .engine.window import WindowResult
    from .engine.window_losses.coupled import CoupledLoss
    from .helpers.lr_scaling import scale_learning_rate
    from .helpers.normalization import (
        apply_accumulation_bn_momentum,
        convert_batchnorm_to_groupnorm,
        freeze_batchnorm,
    )
    from .helpers.planning import AccumulationPlan, CannotShrinkMicroBatchError, plan_accumulation
    from .losses.accumulation_check import AccumulationNotExactError
    from .losses.coupled import clip_coupled_loss, ranking_coupled_loss
    from .losses.moe import WindowRouterBalance
    from .losses.plain_loop import GradientAccumulator
    from .trainer.effective_batch import EffectiveBatchCallback
    from .trainer.trainer import GradAccumTrainer
    from .verification import SplitInvarianceResult, verify_split_invariance
