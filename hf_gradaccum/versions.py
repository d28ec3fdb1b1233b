"""Which releases of torch, transformers and accelerate (and the TRL/PEFT test extras) the package supports and tests.

The package declares floors only (`pyproject.toml`), so `pip install` never replaces a torch, transformers or
accelerate that a user already has. Here the same floors are checked at the point of use, and a release newer than the
newest one CI has tested logs one warning, naming that release, and is used: a new release is never refused.

`TESTED` is the matrix `.ci/compat` runs (docs/compatibility.md); bump its newest entries with the job's pins.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from functools import cache

from packaging.version import InvalidVersion, Version

logger = logging.getLogger("hf_gradaccum")


@dataclass(frozen=True)
class TestedRange:
    """The oldest release supported (and tested) and the newest release CI has tested."""

    oldest: str
    newest: str

    @property
    def requirement(self) -> str:
        return f">={self.oldest}"


TESTED: dict[str, TestedRange] = {
    "torch": TestedRange("2.6.0", "2.14.1"),
    "transformers": TestedRange("4.56.2", "5.24.0"),
    "accelerate": TestedRange("1.10.1", "1.15.0"),
    "trl": TestedRange("1.16.0", "1.16.0"),
    "peft": TestedRange("0.21.2", "0.21.2"),
}


class UnsupportedVersionError(ImportError):
    """An installed release older than the oldest one the package supports."""


def installed_version(package: str) -> str | None:
    """The installed version of `package` (distribution name), or `None` when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def release_of(version: str) -> Version | None:
    """The release number of `version` (`2.11.0+cu128` -> `2.11.0`, `5.25.0.dev0` -> `5.25.0`); `None` if unparsable.

    Local builds and pre-releases count as their release, so a source checkout of a supported line is accepted."""
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return None


def range_status(package: str, version: str | None = None) -> str:
    """
    Where `version` (default: the installed one) of `package` stands against [`TESTED`]: `"tested range"`,
    `"newer than tested (newest tested X)"`, `"older than supported (needs >=X)"`, `"not installed"` or
    `"unparsable version"`.

    Example:

    ```python
    >>> from hf_gradaccum.versions import range_status
    >>> range_status("transformers", "4.57.6")
    'tested range'
    >>> range_status("transformers", "9.0.0")
    'newer than tested (newest tested 5.24.0)'
    ```
    """
    version = installed_version(package) if version is None else version
    if version is None:
        return "not installed"
    release = release_of(version)
    if release is None:
        return "unparsable version"
    tested = TESTED[package]
    if release < Version(tested.oldest):
        return f"older than supported (needs {tested.requirement})"
    if release > Version(tested.newest):
        return f"newer than tested (newest tested {tested.newest})"
    return "tested range"


def check_version(package: str, feature: str, version: str | None = None) -> str | None:
    """
    Check the installed `package` before `feature` uses it: raise [`UnsupportedVersionError`] below the supported
    floor (with the `pip install` that fixes it), log one warning per package when it is newer than the newest tested
    release, and return the version. A release that is merely newer is always accepted.

    Example:

    ```python
    >>> from hf_gradaccum.versions import check_version
    >>> check_version("transformers", "GradAccumTrainer", "5.24.0")
    '5.24.0'
    >>> check_version("transformers", "GradAccumTrainer", "4.55.4")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    UnsupportedVersionError: GradAccumTrainer needs transformers>=4.56.2; found 4.55.4. ...
    ```
    """
    version = installed_version(package) if version is None else version
    if version is None:
        raise UnsupportedVersionError(f"{feature} needs {package}{TESTED[package].requirement}; it is not installed.")
    status = range_status(package, version)
    if status.startswith("older") or status == "unparsable version":
        raise UnsupportedVersionError(
            f"{feature} needs {package}{TESTED[package].requirement}; found {version}. Install a supported release, "
            f'e.g. `pip install "{package}{TESTED[package].requirement}"`.'
        )
    if status.startswith("newer"):
        _warn_newer_once(package, version)
    return version


@cache
def _warn_newer_once(package: str, version: str) -> None:
    # Once per process and package: a new release is expected to work, and a warning per use would be noise.
    logger.warning(
        "hf_gradaccum: %s %s is newer than the newest release it was tested with (%s); it should work. If something "
        "breaks, `hf-gradaccum test` checks this install and `hf-gradaccum env` prints a bug report.",
        package,
        version,
        TESTED[package].newest,
    )
