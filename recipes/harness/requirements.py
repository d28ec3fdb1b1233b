"""The third-party packages a recipe needs beyond `hf_gradaccum`'s own dependencies, checked before it imports them.

`pip install .` installs torch, transformers and accelerate; the recipes also read data with `datasets`, score with
`evaluate`, plot with `matplotlib` and so on, which the `recipes` extra of pyproject.toml installs
(`pip install ".[recipes]"`). Without them a recipe would die on its first import with a traceback; with
[`require_recipe_packages`] at the top of the script it stops with one line naming what to install (exit status 2,
argparse's status for a bad invocation). The check only *finds* the packages (`importlib.util.find_spec`): nothing
is imported, so it costs milliseconds.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

# import name -> distribution name, for every package of the `recipes` extra (pyproject.toml).
RECIPES_EXTRA = {
    "datasets": "datasets",
    "evaluate": "evaluate",
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "pandas": "pandas",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
}
# import name -> distribution name, for packages a recipe needs that the extra does not install.
OTHER_PACKAGES = {"trl": "trl"}


def missing_packages(modules: Iterable[str]) -> list[str]:
    """
    The import names in `modules` that this interpreter cannot find, in the order given.

    Args:
        modules (`Iterable[str]`): top-level import names (`"sklearn"`, not `"scikit-learn"`). For a dotted name only
            the top-level package is looked up, since finding a submodule would import its parent.

    Returns:
        `list[str]`: the names whose top-level package `importlib.util.find_spec` does not find.

    Example:

    ```python
    >>> from harness.requirements import missing_packages
    >>> missing_packages(["json", "no_such_package_here"])
    ['no_such_package_here']
    ```
    """
    missing = []
    for name in modules:
        top = name.partition(".")[0]
        if top in sys.modules:  # already imported (find_spec would also raise for a module without a spec)
            continue
        if importlib.util.find_spec(top) is None:
            missing.append(name)
    return missing


def missing_packages_message(script: str | os.PathLike[str], missing: Iterable[str]) -> str:
    """
    The one line that tells a user of `script` how to install the `missing` import names.

    Packages of the `recipes` extra are named with `pip install ".[recipes]"` (run from the clone, where the recipes
    are); the others (TRL) with their own `pip install`. Either way the plain `pip install <packages>` follows.

    Example:

    ```python
    >>> from harness.requirements import missing_packages_message
    >>> missing_packages_message("recipes/finetune_bert.py", ["datasets", "evaluate"])
    'finetune_bert.py: error: needs datasets, evaluate (not installed); install them with pip install ".[recipes]" from the clone, or pip install datasets evaluate'
    ```
    """
    missing = list(missing)
    distributions = [RECIPES_EXTRA.get(name, OTHER_PACKAGES.get(name, name)) for name in missing]
    others = [dist for name, dist in zip(missing, distributions, strict=True) if name not in RECIPES_EXTRA]
    pronoun = "them" if len(distributions) > 1 else "it"
    plain = "pip install " + " ".join(distributions)
    if len(others) == len(distributions):  # nothing from the extra: the plain command is the whole answer
        how = plain
    else:
        how = f'pip install ".[recipes]"{"".join(" " + dist for dist in others)} from the clone, or {plain}'
    return (
        f"{Path(script).name}: error: needs {', '.join(distributions)} (not installed); install {pronoun} with {how}"
    )


def require_recipe_packages(script: str | os.PathLike[str], *modules: str) -> None:
    """
    Stop the recipe `script` with one line on stderr and exit status 2 when a package it imports is not installed.

    Call it at the top of the script, after the standard-library imports and before the first third-party one, with
    the top-level import names the script and the harness modules it uses need (those of the `recipes` extra, see
    [`RECIPES_EXTRA`], and others such as `trl`). Under a multi-process launch only the first process of each
    machine (`LOCAL_RANK` 0) prints the line; every process exits.

    Args:
        script (`str` or `os.PathLike`): the recipe's `__file__`; its file name starts the message.
        *modules (`str`): top-level import names (`"yaml"` for pyyaml, `"sklearn"` for scikit-learn).

    Raises:
        `SystemExit`: with code 2, when at least one of `modules` cannot be found.

    Example:

    ```python
    >>> from harness.requirements import require_recipe_packages
    >>> require_recipe_packages("finetune_bert.py", "datasets", "evaluate", "matplotlib", "yaml")  # all installed: returns
    >>> require_recipe_packages("sft_tiny.py", "no_such_package_here")  # doctest: +SKIP
    sft_tiny.py: error: needs no_such_package_here (not installed); install it with pip install no_such_package_here
    ```
    """
    missing = missing_packages(modules)
    if missing:
        _refuse(missing_packages_message(script, missing))


def _refuse(message: str) -> NoReturn:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    sys.exit(2)
