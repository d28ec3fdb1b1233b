"""Ready-made TRL argument classes with the accumulation options: `SFTConfig`, `DPOConfig` and `RewardConfig` plus
the fields of [`GradAccumFields`], every TRL default kept (learning rate, logging steps, gradient checkpointing, bf16).

Importing this module imports `trl`; `import hf_gradaccum` does not (these names load lazily), so TRL stays optional.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from trl import DPOConfig, RewardConfig, SFTConfig
except ImportError as error:  # TRL is optional: say what to install instead of a bare ModuleNotFoundError
    raise ImportError(
        "GradAccumSFTConfig, GradAccumDPOConfig and GradAccumRewardConfig need TRL: `pip install trl` "
        "(tested with trl==1.16.0)."
    ) from error

from .arguments import GradAccumFields


@dataclass
class GradAccumSFTConfig(GradAccumFields, SFTConfig):
    """
    TRL's `SFTConfig` with the fields of [`GradAccumFields`], for `class MyTrainer(GradAccumTrainer, SFTTrainer)`.

    Example:

    ```python
    >>> from hf_gradaccum.adapters.trl_support import GradAccumSFTConfig
    >>> args = GradAccumSFTConfig("out", gradient_accumulation_steps=4, use_cpu=True)
    >>> args.learning_rate, args.accumulation_dtype  # TRL's default learning rate is kept
    (2e-05, 'float32')
    ```
    """


@dataclass
class GradAccumDPOConfig(GradAccumFields, DPOConfig):
    """TRL's `DPOConfig` with the fields of [`GradAccumFields`] (all of DPOConfig's defaults kept)."""


@dataclass
class GradAccumRewardConfig(GradAccumFields, RewardConfig):
    """TRL's `RewardConfig` with the fields of [`GradAccumFields`] (all of RewardConfig's defaults kept)."""
