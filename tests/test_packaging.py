"""The release metadata: the version is written once (`__version__` in hf_gradaccum/__init__.py, read by the build
backend), the installed distribution reports that version, and the package ships `py.typed`. Building and installing
the wheel itself is `.ci/wheel`'s job."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

import hf_gradaccum

PACKAGE = Path(hf_gradaccum.__file__).parent
ROOT = PACKAGE.parent


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _version_assignments() -> list[tuple[str, str]]:
    """(file, value) for every `__version__ = "..."` in the package's source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets):
                    value = node.value.value if isinstance(node.value, ast.Constant) else ast.unparse(node.value)
                    found.append((path.relative_to(ROOT).as_posix(), value))
    return found


def test_version_in_one_place_matches_installed_metadata():
    pyproject = _pyproject()
    project = pyproject["project"]
    assert "version" not in project, "pyproject.toml writes the version; it belongs in hf_gradaccum/__init__.py only"
    assert "version" in project.get("dynamic", []), "pyproject.toml must take the version as dynamic"
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "hf_gradaccum.__version__"}, dynamic

    assignments = _version_assignments()
    assert assignments == [("hf_gradaccum/__init__.py", hf_gradaccum.__version__)], assignments
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev|\.post)?\d*", hf_gradaccum.__version__), hf_gradaccum.__version__

    installed = importlib.metadata.version("hf_gradaccum")
    assert installed == hf_gradaccum.__version__, (
        f"the installed distribution says {installed}, hf_gradaccum/__init__.py says {hf_gradaccum.__version__}: "
        "reinstall the package (pip install -e .)"
    )


def test_py_typed_is_shipped():
    assert (PACKAGE / "py.typed").is_file(), "hf_gradaccum/py.typed is missing (the package has type hints)"
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]["hf_gradaccum"]
    assert "py.typed" in package_data, "py.typed must be package data, or the wheel leaves it out"
