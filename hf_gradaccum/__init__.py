"""hf_gradaccum: gradient accumulation that is exactly the large-batch update, for transformers and accelerate."""

from .accumulator import GradientAccumulator, WindowResult
from .arguments import GradAccumArguments
from .items import count_items, count_items_in_batch
from .loss_scaling import DynamicLossScaler
from .trainer import GradAccumTrainer

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScaler",
    "GradAccumArguments",
    "GradAccumTrainer",
    "GradientAccumulator",
    "WindowResult",
    "count_items",
    "count_items_in_batch",
]
