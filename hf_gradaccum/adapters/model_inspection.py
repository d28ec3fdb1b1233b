"""What a model *is*, seen through the wrappers that hide it: PEFT, `torch.compile`, DDP/DataParallel, DeepSpeed.

Item counting needs one fact about the model: whether its loss shifts the labels (a causal LM predicts token `i+1`
at position `i`, so position 0 of each row is never a target and a mean over its loss divides by one item fewer per
row). Wrappers change the class name (`PeftModelForCausalLM`, `OptimizedModule`, `DistributedDataParallel`) and
causal LMs such as `GPT2LMHeadModel` do not say "ForCausalLM" in theirs, so the class name alone misleads. The model
is unwrapped first, then recognised by what it is: its own loss function, the causal-LM class registered for its
`config.model_type`, or a decoder-only model that can generate.
"""

from __future__ import annotations

from torch import nn
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Containers whose wrapped model is `.module` (by name, so that DeepSpeed and FSDP need not be importable).
_MODULE_CONTAINERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "FullyShardedDataParallel")


def unwrap_model(model: nn.Module) -> nn.Module:
    """
    The model under every wrapper: `torch.compile`'s `OptimizedModule` (`._orig_mod`), DDP / DataParallel /
    DeepSpeed / FSDP1 containers (`.module`) and PEFT models (`get_base_model()`), in any nesting.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.adapters.model_inspection import unwrap_model
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


def loss_shifts_labels(model: nn.Module) -> bool | None:
    """
    Whether `model`'s own loss shifts its labels (causal LM): `True`, `False`, or `None` when it cannot be told (a
    model that is not a `transformers` model, e.g. a plain `nn.Module` computing its own loss).

    Recognised as a causal LM, after [`unwrap_model`]: a model whose loss function is `ForCausalLMLoss` (its
    `loss_type`, or a `loss_function` set on it), the causal-LM class that `AutoModelForCausalLM` maps its
    `config.model_type` to (`GPT2LMHeadModel`, `LlamaForCausalLM`, ...), or a decoder-only model that can generate
    text. Encoder-decoder models (T5, BART) align their loss with unshifted labels: `False`.

    Example:

    ```python
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from hf_gradaccum.adapters.model_inspection import loss_shifts_labels
    >>> loss_shifts_labels(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)))
    True
    ```
    """
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "can_generate"):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return False
    # `loss_function` set explicitly on the instance (not the property, which falls back to ForCausalLMLoss for any
    # unknown `loss_type`, BERT heads included).
    custom = model.__dict__.get("_loss_function")
    if custom is not None:
        return custom is ForCausalLMLoss
    if LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss:
        return True
    name = type(model).__name__
    if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return True
    # A decoder-only model with an LM head that `generate` drives predicts the next token: it shifts.
    try:
        return bool(model.can_generate()) and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError, TypeError):
        return False
