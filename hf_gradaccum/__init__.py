"""hf_gradaccum: gradient accumulation that is exactly the large-batch update, for transformers and accelerate."""

from .accumulator import GradientAccumulator, WindowResult
from .arguments import GradAccumArguments
from .items import count_items, count_items_in_batch
from .loss_scaling import DynamicLossScaler
from .lr_scaling import effective_batch_size, lr_scaling_factor, recommended_warmup_steps, scale_learning_rate
from .normalization import (
    BatchNormConversion,
    FrozenBatchNorm,
    accumulation_bn_momentum,
    apply_accumulation_bn_momentum,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
    groupnorm_num_groups,
)
from .planning import AccumulationPlan, CannotShrinkMicroBatchError, plan_accumulation
from .trainer import GradAccumTrainer

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "BatchNormConversion",
    "CannotShrinkMicroBatchError",
    "DynamicLossScaler",
    "FrozenBatchNorm",
    "GradAccumArguments",
    "GradAccumTrainer",
    "GradientAccumulator",
    "WindowResult",
    "accumulation_bn_momentum",
    "apply_accumulation_bn_momentum",
    "convert_batchnorm_to_groupnorm",
    "count_items",
    "count_items_in_batch",
    "effective_batch_size",
    "freeze_batchnorm",
    "groupnorm_num_groups",
    "lr_scaling_factor",
    "plan_accumulation",
    "recommended_warmup_steps",
    "scale_learning_rate",
]
