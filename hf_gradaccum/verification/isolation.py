"""Run a probe on a model in training mode without leaving a trace: dropout off, BatchNorm kept batch-dependent.

The check must see what training sees (BatchNorm normalising by the micro-batch's own statistics is exactly what it
must detect) minus what is random (dropout, router jitter), and must leave the run bitwise as it was: module modes,
every buffer (BatchNorm running statistics, spectral-norm vectors, ...), and the CPU and CUDA random streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

# Float attributes that make a forward random in training mode without being an nn.Dropout module: attention
# dropout passed to scaled_dot_product_attention (Llama, Mistral: `attention_dropout`), MoE router jitter.
_STOCHASTIC_FLOAT_ATTRS = ("dropout", "attention_dropout", "dropout_p", "jitter_noise", "router_jitter_noise")


@dataclass
class ProbeTrace:
    """What the probe did to the model, for the diagnosis: buffers that forward passes changed."""

    changed_buffers: list[str] = field(default_factory=list)


def _is_dropout(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.dropout._DropoutNd) or type(module).__name__.endswith("Dropout")


@contextlib.contextmanager
def isolated_probe(model: nn.Module) -> Iterator[ProbeTrace]:
    """
    Context in which `model` is in training mode with every stochastic layer neutralised; on exit, module modes,
    stochastic attributes, all buffers and the torch CPU/CUDA RNG states are restored. `ProbeTrace.changed_buffers`
    lists the buffers the forward passes inside changed (filled on exit).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.verification.isolation import isolated_probe
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
    >>> with isolated_probe(model):
    ...     model[1].training, model[0].training
    (False, True)
    >>> model[0].training
    False
    ```
    """
    trace = ProbeTrace()
    modes = {module: module.training for module in model.modules()}
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    floats: list[tuple[nn.Module, str, float]] = []
    try:
        model.train()
        for module in model.modules():
            if _is_dropout(module):
                # Both: attention layers read `self.dropout.p` and pass it to the attention kernel when *they* are
                # training (BERT's SDPA path), so eval() on the Dropout module alone does not stop it.
                module.eval()
                if isinstance(getattr(module, "p", None), float) and module.p != 0.0:
                    floats.append((module, "p", module.p))
                    module.p = 0.0
            for attr in _STOCHASTIC_FLOAT_ATTRS:
                value = module.__dict__.get(attr)
                if isinstance(value, float) and value != 0.0:
                    floats.append((module, attr, value))
                    setattr(module, attr, 0.0)
        yield trace
    finally:
        for module, attr, value in floats:
            setattr(module, attr, value)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                saved = buffers.get(name)
                if saved is None or saved.shape != buf.shape:
                    continue
                if not torch.equal(saved, buf):
                    trace.changed_buffers.append(name)
                buf.copy_(saved)
        for module, mode in modes.items():
            module.training = mode
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
