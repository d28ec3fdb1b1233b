"""Checks of model and data sources that take milliseconds, run before anything loads (`hf-gradaccum verify`, the
recipes): a wrong path or an unreachable Hub id costs one line at once, not a model load and a client's retries."""

from __future__ import annotations

import os

# A reachability probe, not a download: one TCP connection with a short timeout instead of a client's retries.
HUB_PROBE_TIMEOUT_S = 3.0
DATA_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet", ".txt", ".tsv")


class InputError(ValueError):
    """A bad argument or input file, reported as one line (exit status 2 in the CLI and the recipes)."""


def _hub_offline() -> bool:
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))  # fmt: skip


def hub_unreachable_reason() -> str | None:
    """Why the Hub cannot be used now (offline mode, or no connection within a few seconds), or None."""
    if _hub_offline():
        return "the Hub is switched off (HF_HUB_OFFLINE=1)"
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as error:
        return f"{constants.ENDPOINT} cannot be reached ({type(error).__name__}: {error})"
    return None


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or value.endswith(DATA_SUFFIXES) or value.count("/") > 1


def check_model_source(value: str, flag: str = "--model") -> None:
    """
    Fail at once, with one line naming `flag`, unless `value` is a model folder, a cached Hub id, or a Hub id while
    the Hub can be reached (one TCP connection with a 3 s timeout, not a client's retries).

    Example:

    ```python
    >>> from hf_gradaccum.input_checks import InputError, check_model_source
    >>> try:
    ...     check_model_source("/nonexistent/model", "--model_name_or_path")
    ... except InputError as error:
    ...     print(error)
    --model_name_or_path /nonexistent/model: no such folder, and not a Hub id.
    ```
    """
    if os.path.exists(value):
        if not os.path.isfile(os.path.join(value, "config.json")):
            raise InputError(f"{flag} {value}: not a model folder (no config.json in it).")
        return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        raise InputError(f"{flag} {value}: no such folder, and not a Hub id.") from None
    if _looks_like_path(value):
        raise InputError(f"{flag} {value}: no such folder.")
    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return  # in the local cache: loads without the network
    reason = hub_unreachable_reason()
    if reason is not None:
        raise InputError(f"{flag} {value}: no such folder, and it is not in the local cache while {reason}.")


def check_dataset_source(value: str, flag: str = "--dataset") -> None:
    """Fail at once, with one line naming `flag`, unless `value` is a local file/folder or a usable Hub dataset."""
    if os.path.exists(value):
        return
    if _looks_like_path(value):
        raise InputError(f"{flag} {value}: no such file or folder.")
    from huggingface_hub import constants

    cached = [os.path.join(constants.HF_HUB_CACHE, "datasets--" + value.replace("/", "--")),
              os.path.join(os.environ.get("HF_DATASETS_CACHE", os.path.join(constants.HF_HOME, "datasets")),
                           value.replace("/", "___"))]  # fmt: skip
    if any(os.path.isdir(path) for path in cached):
        return
    reason = hub_unreachable_reason()
    if reason is not None:
        raise InputError(f"{flag} {value}: no such file, and not in the local cache while {reason}.")
