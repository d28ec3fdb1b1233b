"""Where a mode that replaces the loss needs `GradAccumTrainer` in a composed trainer's class order."""

from __future__ import annotations


def require_first_in_class_order(trainer_cls: type, option: str, gradaccum_cls: type) -> None:
    """A mode that replaces the loss must see `compute_loss` before a composed trainer does: raise a `ValueError`
    naming `option` and the class order to use when another trainer's `compute_loss` comes before `gradaccum_cls`'s
    (`GradAccumTrainer`, handed in: this module sits below it).

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.trainer.class_order import require_first_in_class_order
    >>> class Own(Trainer):
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None): ...
    >>> require_first_in_class_order(type("T", (GradAccumTrainer, Own), {}), "`coupled_loss`", GradAccumTrainer)
    >>> require_first_in_class_order(type("T", (Own, GradAccumTrainer), {}), "`coupled_loss`", GradAccumTrainer)
    Traceback (most recent call last):
    ...
    ValueError: `coupled_loss` needs GradAccumTrainer before Own in the class order (its `compute_loss` would run first): `class T(GradAccumTrainer, Own)`.
    ```
    """
    for cls in trainer_cls.__mro__:
        if cls is gradaccum_cls:
            return
        if not issubclass(cls, gradaccum_cls) and "compute_loss" in vars(cls):
            raise ValueError(
                f"{option} needs GradAccumTrainer before {cls.__name__} in the class order (its `compute_loss` would "
                f"run first): `class {trainer_cls.__name__}(GradAccumTrainer, {cls.__name__})`."
            )
