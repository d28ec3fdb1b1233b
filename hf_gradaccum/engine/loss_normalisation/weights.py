"""What the losses of a cut say about the weights of its parts, and when two rules weigh a window alike.

A loss that is a weighted mean satisfies `L (W_a + W_b) = W_a L_a + W_b L_b` on a cut, so the losses of two parts and
of their union give `W_a / W_b = (L_b - L) / (L - L_a)` without any candidate count. That ratio is ill-conditioned
when `L_a ~ L_b`, and a negative one means the loss is not a mean at all. A count with free parameters (one weight per
class) enters the same identity linearly: `w . (n_a (L - L_a) + n_b (L - L_b)) = 0` on every cut, so `w` is the null
vector of the cuts' equations, determined once there are as many independent cuts as classes less one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

ReduceMax = Callable[[list[float]], list[float]]


def measured_ratio(whole: float, part_a: float, part_b: float, tolerance: float) -> float | None:
    """
    `W_a / W_b` as the losses of a cut imply it for a weighted mean; `None` where it is ill-conditioned (the parts'
    losses within the tolerance's reach of each other), negative where no mean fits.

    Example:

    ```python
    >>> round(measured_ratio(whole=2.0, part_a=1.0, part_b=4.0, tolerance=1e-6), 6)  # (1*2 + 4*1)/3 = 2
    2.0
    ```
    """
    scale = max(abs(whole), abs(part_a), abs(part_b), 1e-12)
    if abs(part_a - part_b) <= 100 * tolerance * scale or abs(whole - part_a) <= tolerance * scale:
        return None
    return (part_b - whole) / (whole - part_a)


def same_window_weights(
    a: Sequence[float], b: Sequence[float], reduce_max: ReduceMax | None = None, rel_tol: float = 1e-9
) -> bool:
    """Whether counts `a` and `b` of the same micro-batches are proportional (on every rank, with one constant): the
    two rules give every micro-batch the same weight, hence the same update."""
    total_a, total_b = float(sum(a)), float(sum(b))
    local = 0.0
    if total_a <= 0 or total_b <= 0:
        local = 0.0 if total_a == total_b == 0 else 1.0
        ratio = 1.0
    else:
        ratio = total_a / total_b
        local = 0.0 if all(math.isclose(x * total_b, y * total_a, rel_tol=rel_tol, abs_tol=1e-12) for x, y in zip(a, b, strict=True)) else 1.0  # fmt: skip
    if reduce_max is None:
        return local == 0.0
    flag, high, negative_low = reduce_max([local, ratio, -ratio])
    return flag == 0.0 and math.isclose(high, -negative_low, rel_tol=rel_tol)


def window_classes(
    rules: Sequence[str], counts: Mapping[str, Sequence[float]], reduce_max: ReduceMax | None = None
) -> list[list[str]]:
    """`rules` grouped by the weights they give the window's micro-batches (`counts[rule]`: one count per
    micro-batch; `"sum"` forms a class of its own), in the order of `rules`."""
    classes: list[list[str]] = []
    for rule in rules:
        for group in classes:
            head = group[0]
            if "sum" in (head, rule):
                continue
            if same_window_weights(counts[head], counts[rule], reduce_max):
                group.append(rule)
                break
        else:
            classes.append([rule])
    return classes


def fit_class_weights(
    equations: Sequence[tuple[Sequence[float], Sequence[float], float, float, float]], classes: int, tolerance: float
) -> list[float] | None:
    """
    The per-class weights `w` (largest 1) under which every cut `(n_a, n_b, L, L_a, L_b)` adds up, where the cuts
    determine them; `None` where they do not (too few independent cuts, no positive solution, or none that fits).

    Example:

    ```python
    >>> # class weights (1, 3): part a holds one item of class 0 (loss 1), part b one of class 1 (loss 2)
    >>> whole = (1 * 1.0 + 3 * 2.0) / 4
    >>> w = fit_class_weights([([1, 0], [0, 1], whole, 1.0, 2.0), ([2, 0], [0, 1], (2 * 1.0 + 3 * 2.0) / 5, 1.0, 2.0)], 2, 1e-6)
    >>> [round(x, 6) for x in w]
    [0.333333, 1.0]
    ```
    """
    if len(equations) < classes - 1:
        return None
    rows = []
    for n_a, n_b, whole, part_a, part_b in equations:
        scale = max(abs(whole), 1e-12)
        rows.append([(x * (whole - part_a) + y * (whole - part_b)) / scale for x, y in zip(n_a, n_b, strict=True)])
    matrix = torch.tensor(rows, dtype=torch.float64)
    if not bool(torch.isfinite(matrix).all()):
        return None
    _, sigma, vh = torch.linalg.svd(matrix, full_matrices=True)
    if sigma.numel() < classes - 1 or float(sigma[0]) <= 0:
        return None
    # Determined: every direction but one is pinned down by the cuts.
    if classes >= 2 and float(sigma[min(classes - 2, sigma.numel() - 1)]) <= 1e3 * tolerance * float(sigma[0]):
        return None
    w = vh[-1]
    if float(w.abs().max()) == 0:
        return None
    w = w / w[w.abs().argmax()]
    if bool((w <= 1e-6).any()):
        return None
    return (w / w.max()).tolist()
