"""Loading a pretrained backbone with a new task head, saying so in one line instead of a warning table.

transformers 5.x logs a "LOAD REPORT" table (with terminal colour codes) whenever a checkpoint lacks some of the
model's weights. For a classifier built on a pretrained backbone, the new head is *expected* to be missing, and a
newcomer reads the table as something being wrong. Here the head's keys are reported in one line; anything else that
is missing, unexpected or mismatched is still shown as transformers' full report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from transformers.utils import logging as hf_logging

from .arms import is_rank_zero

# The logger `PreTrainedModel.from_pretrained` writes its load report to.
_MODELING_LOGGER = "transformers.modeling_utils"


def _drop_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in record.getMessage()


def load_with_new_head(
    from_pretrained: Callable[..., Any],
    path: str,
    *,
    head_prefixes: Sequence[str] = ("classifier.", "score.", "qa_outputs."),
    **kwargs: Any,
) -> Any:
    """
    `from_pretrained(path, **kwargs)`, printing one line for newly initialised task-head weights (keys starting with
    one of `head_prefixes`) instead of transformers' load report. Any other missing, unexpected or mismatched weight
    is reported by loading again with transformers' own report (so nothing is hidden).

    Example:

    ```python
    >>> from transformers import AutoModelForSequenceClassification
    >>> model = load_with_new_head(AutoModelForSequenceClassification.from_pretrained, path, num_labels=2)  # doctest: +SKIP
    New task head (randomly initialised, as expected): classifier.bias, classifier.weight
    ```
    """
    logger = hf_logging.get_logger(_MODELING_LOGGER)
    # A filter for the report only, not a higher logger level: transformers 5.23 runs its tensor-parallel plan check
    # (and warns "layers were not sharded") exactly when this logger's level is WARNING or above.
    logger.addFilter(_drop_load_report)
    try:
        model, info = from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        logger.removeFilter(_drop_load_report)
    missing = sorted(info.get("missing_keys", ()))
    head = [key for key in missing if key.startswith(tuple(head_prefixes))]
    other_problems = [key for key in missing if key not in head]
    other_problems += list(info.get("unexpected_keys", ())) + list(info.get("mismatched_keys", ()))
    if other_problems:
        # Not just the head: let transformers print its full report, which is then worth reading.
        return from_pretrained(path, **kwargs)
    if head and is_rank_zero():  # once, not once per process of a multi-process launch
        print(f"New task head (randomly initialised, as expected): {', '.join(head)}")
    return model
