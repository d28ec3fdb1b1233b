"""Which library trainer a `GradAccumTrainer` is composed with: the class whose loss is being accumulated.

Rows of the registry (`integrations/registry.py`) and the feature slices (`integrations/trl/grpo.py`, ...) are chosen by
the *nearest* library class in the MRO, not by any base class: a subclass that changes the loss (TRL's GMPO of GRPO,
GKD and GOLD of SFT) is a trainer of its own, unknown until it has a row.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Collection
from typing import Any

from transformers import Trainer


@functools.cache
def installed_top_level_modules() -> frozenset[str]:
    """
    Top-level module names of the installed distributions (read once per process).

    Example:

    ```python
    >>> from hf_gradaccum.losses.composed_class import installed_top_level_modules
    >>> "torch" in installed_top_level_modules()
    True
    ```
    """
    return frozenset(importlib.metadata.packages_distributions())


def _is_library_class(cls: type) -> bool:
    root = cls.__module__.split(".")[0]
    return root == "transformers" or root in installed_top_level_modules()


def nearest_trainer_named(trainer: Any, names: Collection[str]) -> str | None:
    """
    The name of the nearest `Trainer` subclass in the MRO of `trainer` (an instance or a class) that is in `names`,
    looking through hf_gradaccum's classes and past the user's own, but never past a library class: `None` when a
    library class not in `names` comes first (a subclass with a loss of its own), or none is in `names`.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.losses.composed_class import nearest_trainer_named
    >>> nearest_trainer_named(GradAccumTrainer, {"Trainer"})
    'Trainer'
    ```
    """
    cls0 = trainer if isinstance(trainer, type) else type(trainer)
    for cls in cls0.__mro__:
        if cls.__module__.split(".")[0] == "hf_gradaccum" or not issubclass(cls, Trainer):
            continue
        if cls.__name__ in names:
            return cls.__name__
        if _is_library_class(cls):
            return None
    return None


def library_trainer(trainer: Any) -> type | None:
    """
    The nearest `Trainer` subclass in the MRO of `trainer` (an instance or a class) that transformers or another
    installed package ships, looking through hf_gradaccum's classes and the user's own (code not installed as a
    package); `None` when there is none.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.losses.composed_class import library_trainer
    >>> library_trainer(GradAccumTrainer) is Trainer
    True
    ```
    """
    cls0 = trainer if isinstance(trainer, type) else type(trainer)
    for cls in cls0.__mro__:
        if cls.__module__.split(".")[0] == "hf_gradaccum" or not issubclass(cls, Trainer):
            continue
        if _is_library_class(cls):
            return cls
    return None
