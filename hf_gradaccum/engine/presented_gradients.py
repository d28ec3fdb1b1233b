"""A window's gradient so far, shown in `.grad` to code that runs between micro-batches without owning them.

In the middle of a window the accumulator's own state is a sum (the in-place path's `.grad`, or the hook path's
buffers, where `.grad` is `None`). Code written for the stock Trainer reads and changes `.grad` after every backward:
it logs a norm, masks rows of an embedding, clips by value. Handed the sum, such code would change what the step
applies (a clip of a partial sum is not a clip of the mean), or fail on a `None`. So between micro-batches `.grad` can
show copies, the mean so far, and the accumulator's own tensors are put back before its next backward: whatever was
done to the copies cannot reach the window, and a change to them is seen (`changed`).
"""

from __future__ import annotations

from typing import Any

import torch

from .buffers import FlatGradientBuffers


def gradient_fingerprint(parameters: list[torch.nn.Parameter]) -> list[tuple[int, int] | None]:
    """Each `.grad`'s identity and version counter: a backward into it, an in-place change, `zero_grad()` or a new
    tensor changes it."""
    return [None if (g := p.grad) is None else (id(g), g._version) for p in parameters]


class PresentedGradients:
    """
    Copies of the window's gradient so far, as a mean over a number of items, put in `.grad` until `withdraw`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum import GradientAccumulator
    >>> model = torch.nn.Linear(2, 1, bias=False)
    >>> acc = GradientAccumulator(model, 2)
    >>> acc.backward(model(torch.ones(1, 2)).sum(), num_items=1)
    >>> shown = acc.present_window_so_far(2)
    >>> model.weight.grad.tolist()
    [[0.5, 0.5]]
    >>> _ = model.weight.grad.mul_(0)  # code between micro-batches changes what it sees ...
    >>> shown.changed(), shown.withdraw()
    (True, None)
    >>> acc.backward(model(torch.ones(1, 2)).sum(), num_items=1)
    >>> _ = acc.finish_window()
    >>> model.weight.grad.tolist()  # ... and the window is untouched
    [[1.0, 1.0]]
    ```
    """

    def __init__(self, parameters: list[torch.nn.Parameter], kept: list[torch.Tensor | None] | None) -> None:
        self.parameters = parameters
        self.kept = kept
        self.shown = gradient_fingerprint(parameters)

    @classmethod
    def of(cls, accumulator: Any, num_items: float) -> PresentedGradients | None:
        """Present `accumulator`'s open window divided by `num_items`; `None` where its buffers are sharded or held
        elsewhere than on the parameters' device."""
        params = accumulator.parameters
        if accumulator.in_place:
            kept = [p.grad for p in params]
            with torch.no_grad():
                for p, g in zip(params, kept, strict=True):
                    p.grad = None if g is None else g / num_items
            return cls(params, kept)
        if type(accumulator.buffers) is not FlatGradientBuffers:  # sharded, or folded on the host
            return None
        views = accumulator.buffers.views
        touched = accumulator._window.touched
        with torch.no_grad():
            for i, p in enumerate(params):
                p.grad = (views[i] / num_items).to(p.dtype) if touched[i] else None
        return cls(params, None)

    def changed(self) -> bool:
        """Whether anything changed a shown gradient (a backward, an in-place change, a new tensor, `None`)."""
        return gradient_fingerprint(self.parameters) != self.shown

    def withdraw(self) -> None:
        """Put the accumulator's own tensors back (the hook path: no `.grad`)."""
        for i, p in enumerate(self.parameters):
            p.grad = None if self.kept is None else self.kept[i]
