"""What a model *is*: the engine's duck-typed inspection (`engine/model_inspection.py`) plus transformers' own
registries, which the engine may not import.

Item counting needs one fact about the model: whether its loss shifts the labels (causal LM). The engine recognises
causal LMs by the name of the loss their forward calls and by their ability to generate; this layer adds the
causal-LM classes that `AutoModelForCausalLM` maps each `config.model_type` to, and the loss types transformers maps to
its causal-LM loss.
"""

from __future__ import annotations

from torch import nn
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..engine.model_inspection import loss_shifts_labels as _duck_typed_loss_shifts_labels
from ..engine.model_inspection import unwrap_model

__all__ = ["loss_shifts_labels", "unwrap_model"]


def _registered_causal_lm(model: nn.Module) -> bool:
    """Whether transformers' registries call `model` a causal LM: its `loss_type` maps to `ForCausalLMLoss`, or its
    class is the one `AutoModelForCausalLM` builds for some `model_type`."""
    if LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss:
        return True
    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def loss_shifts_labels(model: nn.Module) -> bool | None:
    """
    Whether `model`'s own loss shifts its labels (causal LM): `True`, `False`, or `None` when it cannot be told (a
    model that is not a `transformers` model, e.g. a plain `nn.Module` computing its own loss).

    The engine's [`~hf_gradaccum.engine.model_inspection.loss_shifts_labels`] (after unwrapping PEFT, compile and DDP:
    the loss function's name, a decoder-only model that can generate), with transformers' registries as a further
    witness: the causal-LM class that `AutoModelForCausalLM` maps its `config.model_type` to (`GPT2LMHeadModel`,
    `LlamaForCausalLM`, ...). Encoder-decoder models (T5, BART) align their loss with unshifted labels: `False`.

    Example:

    ```python
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from hf_gradaccum.losses.model_inspection import loss_shifts_labels
    >>> loss_shifts_labels(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)))
    True
    ```
    """
    return _duck_typed_loss_shifts_labels(model, is_causal_lm_class=_registered_causal_lm)
