"""What a model *is*, seen through the wrappers that hide it (PEFT, `torch.compile`, DDP/DataParallel, DeepSpeed),
by duck typing only: the engine must not import transformers.

Item counting needs one fact about the model: whether its loss shifts the labels (a causal LM predicts token `i+1`
at position `i`, so position 0 of each row is never a target and a mean over its loss divides by one item fewer per
row). Wrappers change the class name (`PeftModelForCausalLM`, `OptimizedModule`, `DistributedDataParallel`) and
causal LMs such as `GPT2LMHeadModel` do not say "ForCausalLM" in theirs, so the class name alone misleads. The model
is unwrapped first, then recognised by what it is: the loss function its forward calls, or a decoder-only model with
an LM head that can generate. `hf_gradaccum.losses.model_inspection` adds transformers' own registries on top.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# Containers whose wrapped model is `.module` (by name, so that DeepSpeed and FSDP need not be importable).
_MODULE_CONTAINERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "FullyShardedDataParallel")
# The name of transformers' causal-LM loss (`transformers.loss.loss_utils.ForCausalLMLoss`), matched by name.
CAUSAL_LM_LOSS_NAME = "ForCausalLMLoss"


def unwrap_model(model: nn.Module) -> nn.Module:
    """
    The model under every wrapper: `torch.compile`'s `OptimizedModule` (`._orig_mod`), DDP / DataParallel /
    DeepSpeed / FSDP1 containers (`.module`) and PEFT models (`get_base_model()`), in any nesting.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.model_inspection import unwrap_model
    >>> inner = torch.nn.Linear(2, 2)
    >>> unwrap_model(torch.nn.DataParallel(inner)) is inner
    True
    ```
    """
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif type(model).__name__ in _MODULE_CONTAINERS and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
    return model


def loss_shifts_labels(
    model: nn.Module, *, is_causal_lm_class: Callable[[nn.Module], bool] | None = None
) -> bool | None:
    """
    Whether `model`'s own loss shifts its labels (causal LM): `True`, `False`, or `None` when it cannot be told (a
    model that is not a `transformers` model, e.g. a plain `nn.Module` computing its own loss).

    Recognised as a causal LM, after [`unwrap_model`], by duck typing: a model whose loss function (a
    `loss_function` set on the instance, or the one its `loss_type` selects) is named `ForCausalLMLoss`, a model
    that `is_causal_lm_class` accepts (the adapters pass transformers' `AutoModelForCausalLM` registry), or a
    decoder-only model that can generate text from an LM head. Encoder-decoder models (T5, BART) align their loss
    with unshifted labels: `False`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.model_inspection import loss_shifts_labels
    >>> loss_shifts_labels(torch.nn.Linear(2, 2)) is None  # not a transformers model: cannot be told
    True
    ```
    """
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "can_generate"):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return False
    # A `loss_function` set explicitly on the instance (read from `__dict__`, not through the property).
    custom = model.__dict__.get("_loss_function")
    if custom is not None:
        return getattr(custom, "__name__", None) == CAUSAL_LM_LOSS_NAME
    # With a `loss_type`, the property returns the loss the forward calls. Without one it falls back to the causal-LM
    # loss for any model, BERT heads included, so it is not asked then.
    if getattr(model, "loss_type", None) is not None:
        try:
            if getattr(model.loss_function, "__name__", None) == CAUSAL_LM_LOSS_NAME:
                return True
        except (AttributeError, KeyError, TypeError):
            pass
    if is_causal_lm_class is not None and is_causal_lm_class(model):
        return True
    # A decoder-only model with an LM head that `generate` drives predicts the next token: it shifts.
    try:
        return bool(model.can_generate()) and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError, TypeError):
        return False
