"""Run a probe on a model in training mode without leaving a trace: randomness off, BatchNorm kept batch-dependent.

The check must see what training sees (BatchNorm normalising by the micro-batch's own statistics is exactly what it
must detect) minus what is random, and must leave the run bitwise as it was. Randomness in a forward hides in three
places, and all three are neutralised for the probe only:

- modules: `nn.Dropout` and anything named like it, stochastic depth (timm's `DropPath`, torchvision's
  `StochasticDepth`, found by duck typing), put in eval mode with their probability zeroed;
- float attributes read at forward time: `self.dropout` passed to the attention kernel, `self.layerdrop` (BART),
  router jitter, any `*drop*` or `mask_*prob` attribute of a module;
- configurations (`model.config` and every sub-module's): `layerdrop`, `*dropout*`, `drop_path_rate`,
  `mask_time_prob`/`mask_feature_prob` (SpecAugment, drawn from numpy's RNG in Wav2Vec2), any `*drop*` or
  `mask_*prob` probability, since modules such as Wav2Vec2's encoder read `self.config.layerdrop` at forward time.

On exit, everything changed is put back: module modes, attributes, config fields, every buffer (BatchNorm running
statistics, spectral-norm vectors), and the torch CPU/CUDA, numpy and Python `random` generators.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine.rng import capture_rng_state, restore_rng_state

# Names of float attributes / config fields that are probabilities of something random happening in a forward:
# dropout of every kind, layer drop, stochastic depth (drop_path_rate, drop_prob), masking probabilities
# (mask_time_prob, mask_feature_prob), router jitter.
_STOCHASTIC_NAME = re.compile(r"drop|^mask_.*prob$|jitter|stochastic_depth")
# Modules that are random in training mode by construction.
_STOCHASTIC_MODULE = re.compile(r"Dropout$|DropPath|StochasticDepth|DropBlock|LayerDrop")


@dataclass
class ProbeTrace:
    """What the probe did to the model: the stochastic parts it neutralised, the buffers that forward passes changed
    (filled on exit), and `reset_buffers()` to start a computation from the model's own state again."""

    neutralised: list[str] = field(default_factory=list)
    changed_buffers: list[str] = field(default_factory=list)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)

    def reset_buffers(self) -> None:
        """Put every buffer back to its value at the start of the probe, noting those that forward passes changed.

        Each split is computed from the same state, so that a stateful layer (spectral norm's power iteration)
        makes the splits differ, as it does in training, but not two runs of the same split."""
        if self._model is None:
            return
        with torch.no_grad():
            for name, buf in self._model.named_buffers():
                saved = self._buffers.get(name)
                if saved is None or saved.shape != buf.shape:
                    continue
                if not torch.equal(saved, buf):
                    if name not in self.changed_buffers:
                        self.changed_buffers.append(name)
                    buf.copy_(saved)


def is_stochastic_module(module: nn.Module) -> bool:
    """Dropout-like modules, by type or by name (timm's DropPath, torchvision's StochasticDepth, ...)."""
    return isinstance(module, nn.modules.dropout._DropoutNd) or bool(_STOCHASTIC_MODULE.search(type(module).__name__))


def is_stochastic_name(name: str) -> bool:
    """Whether an attribute or config field called `name` is (by convention) the probability of a random event."""
    return bool(_STOCHASTIC_NAME.search(name.lower()))


def model_configs(model: nn.Module) -> list[tuple[str, Any]]:
    """The configuration objects of `model` and its sub-modules (`.config` with `to_dict`), once each, by owner."""
    seen, out = set(), []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "to_dict"):
            seen.add(id(config))
            out.append((name, config))
            # Composite configs (encoder-decoder, vision-text) hold sub-configs read by their own modules.
            for key, value in list(vars(config).items()):
                if hasattr(value, "to_dict") and id(value) not in seen and not isinstance(value, type):
                    seen.add(id(value))
                    out.append((f"{name}.{key}" if name else key, value))
    return out


def _probability(value: Any) -> bool:
    return isinstance(value, float) and not isinstance(value, bool) and 0.0 < value <= 1.0


@contextlib.contextmanager
def isolated_probe(model: nn.Module) -> Iterator[ProbeTrace]:
    """
    Context in which `model` is in training mode with every stochastic part neutralised (see the module docstring);
    on exit, module modes, attributes, config fields, all buffers and all RNG states are restored.
    `ProbeTrace.neutralised` names what was switched off; `ProbeTrace.changed_buffers` lists the buffers forward
    passes changed (filled by `reset_buffers()` and on exit).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.verification.isolation import isolated_probe
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
    >>> with isolated_probe(model) as trace:
    ...     model[1].training, model[0].training, trace.neutralised
    (False, True, ['1 (Dropout)'])
    >>> model[0].training, model[1].p
    (False, 0.5)
    ```
    """
    modes = {module: module.training for module in model.modules()}
    trace = ProbeTrace(_buffers={n: b.detach().clone() for n, b in model.named_buffers()}, _model=model)
    rng = capture_rng_state()
    saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original value), restored in reverse order

    def zero(owner: Any, attr: str, label: str) -> None:
        value = getattr(owner, attr)
        try:
            setattr(owner, attr, 0.0)
        except Exception:  # a frozen or validated config: left on, and caught by the determinism test if it matters
            return
        saved.append((owner, attr, value))
        trace.neutralised.append(label)

    try:
        model.train()
        for name, module in model.named_modules():
            if is_stochastic_module(module):
                # Both eval() and p=0: attention layers read `self.dropout.p` and pass it to the attention kernel
                # when *they* are training (BERT's SDPA path), so eval() on the Dropout module alone does not stop it.
                module.eval()
                for attr in ("p", "drop_prob"):
                    if _probability(module.__dict__.get(attr)):
                        saved.append((module, attr, module.__dict__[attr]))
                        setattr(module, attr, 0.0)
                trace.neutralised.append(f"{name or '<root>'} ({type(module).__name__})")
                continue
            for attr, value in list(module.__dict__.items()):
                if _probability(value) and is_stochastic_name(attr):
                    zero(module, attr, f"{name or '<root>'}.{attr}={value}")
        for owner, config in model_configs(model):
            for attr, value in list(vars(config).items()):
                if _probability(value) and is_stochastic_name(attr):
                    zero(config, attr, f"{owner + '.' if owner else ''}config.{attr}={value}")
        yield trace
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
        trace.reset_buffers()
        for module, mode in modes.items():
            module.training = mode
        restore_rng_state(rng)
