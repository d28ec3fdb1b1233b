"""Metric modules that `evaluate` can load offline (the Hub's own metric scripts need the network).

Example:

```python
>>> import evaluate
>>> from harness.metrics import metric_path
>>> accuracy = evaluate.load(metric_path("accuracy"))
>>> accuracy.compute(predictions=[1, 0], references=[1, 1])["accuracy"]
0.5
```
"""

from __future__ import annotations

from pathlib import Path

_METRICS_DIR = Path(__file__).resolve().parent

AVAILABLE_METRICS = ("accuracy",)


def metric_path(name: str) -> str:
    """
    The directory of the metric module `name`, to pass to `evaluate.load`.

    Args:
        name (`str`): one of [`AVAILABLE_METRICS`].

    Returns:
        `str`: an absolute path; `evaluate.load` imports `<path>/<name>.py` from it without the network.

    Example:

    ```python
    >>> from harness.metrics import metric_path
    >>> metric_path("accuracy").endswith("accuracy")
    True
    ```
    """
    if name not in AVAILABLE_METRICS:
        raise ValueError(f"Unknown metric {name!r}; hf_gradaccum ships {list(AVAILABLE_METRICS)}.")
    return str(_METRICS_DIR / name)
