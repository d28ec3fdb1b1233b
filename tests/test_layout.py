"""The package layout is the architecture: each part imports only the parts below it.

    engine   <- torch (+ accelerate.utils); no transformers, nothing else of this package
    helpers  <- engine
    adapters <- engine, helpers (+ transformers)
    diagnostics <- engine, helpers (`hf-gradaccum env` / `test`; tiny transformers models, nothing downloaded)

The recipes' experiment machinery (`recipes/harness/`) is not part of the installed package: it imports the package,
the package (and its `hf-gradaccum` CLI) never imports it. `import hf_gradaccum` imports none of the parts (lazy
public names), so it never pulls in matplotlib.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hf_gradaccum

PACKAGE = Path(hf_gradaccum.__file__).parent
# part -> parts of this package it may import (itself always allowed)
ALLOWED = {
    "engine": set(),
    "helpers": {"engine"},
    "verification": {"engine", "helpers"},
    "adapters": {"engine", "helpers", "verification"},
    "diagnostics": {"engine", "helpers"},
}
HARNESS = PACKAGE.parent / "recipes" / "harness"
# third-party packages a part must not import
FORBIDDEN = {"engine": {"transformers", "matplotlib", "trl", "peft"}, "helpers": {"transformers", "matplotlib"}}


def _imports(path: Path) -> set[str]:
    """Absolute dotted names imported by `path`, relative imports resolved against the package."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            else:
                names.add(node.module)
    return names


def _part_modules():
    for part in ALLOWED:
        for path in sorted((PACKAGE / part).rglob("*.py")) if (PACKAGE / part).is_dir() else []:
            yield part, path


@pytest.mark.parametrize(("part", "path"), list(_part_modules()), ids=lambda v: str(v).rsplit("hf_gradaccum/", 1)[-1])
def test_each_part_imports_only_the_parts_below_it(part, path):
    for name in _imports(path):
        top = name.split(".")
        if top[0] == "hf_gradaccum" and len(top) > 1 and top[1] in ALLOWED and top[1] != part:
            assert top[1] in ALLOWED[part], f"{path.name} ({part}) imports {name}; {part} may import {ALLOWED[part]}"
        assert top[0] not in FORBIDDEN.get(part, set()), f"{path.name} ({part}) imports {name}"


def test_the_harness_is_not_in_the_installed_package():
    assert not (PACKAGE / "harness").exists()
    assert (HARNESS / "arms.py").is_file() and (HARNESS / "metrics" / "accuracy" / "accuracy.py").is_file()
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _imports(path):
            assert name.split(".")[0] != "harness" and not name.startswith("hf_gradaccum.harness"), (path, name)


def test_the_harness_imports_only_the_installed_package():
    """`recipes/harness/` sees the package as a user does: absolute `hf_gradaccum` imports, no relative escapes."""
    for path in sorted(HARNESS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                raise AssertionError(f"{path} imports from outside the harness: level {node.level}")


def test_import_hf_gradaccum_imports_no_matplotlib_nor_the_harness():
    code = (
        "import sys, hf_gradaccum, hf_gradaccum.cli\n"
        "hf_gradaccum.GradientAccumulator, hf_gradaccum.GradAccumTrainer, hf_gradaccum.plan_accumulation\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'harness'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_bare_import_is_lazy():
    code = "import sys, hf_gradaccum\nprint(sorted(m for m in sys.modules if m.startswith('hf_gradaccum.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_every_public_name_resolves():
    for name in hf_gradaccum.__all__:
        assert getattr(hf_gradaccum, name) is not None
    assert set(hf_gradaccum.__all__) == set(hf_gradaccum._EXPORTS)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_gradaccum.nope  # noqa: B018
