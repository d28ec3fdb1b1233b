"""The package layout is the architecture (docs/architecture.md): each folder is a floor that imports only the floors
below it, as its `__init__` docstring declares on its `May import:` line.

    engine                     torch (+ accelerate.utils); nothing else of this package, no transformers
    helpers, verification      engine
    diagnostics                engine, helpers (+ the top-level versions.py)
    config                     engine, helpers (+ versions.py): the arguments and the transformers releases
    distributed                engine, helpers, config
    losses                     engine, helpers, verification, config, distributed
    integrations               engine, helpers, verification, config, distributed, losses
    trainer                    all of the above; integrations through `integrations/registry.py` only

and the rules every folder follows:
- no import loop between modules, counting imports inside functions and under `TYPE_CHECKING`;
- no folder is a flat list of more than 15 modules;
- no module over 600 lines unless docs/architecture.md names it with the reason (at most two are).

The recipes' experiment machinery (`recipes/harness/`) is not part of the installed package: it imports the package,
the package (and its `hf-gradaccum` CLI) never imports it. `import hf_gradaccum` imports none of the parts (lazy
public names), so it never pulls in matplotlib.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_gradaccum

PACKAGE = Path(hf_gradaccum.__file__).parent
ROOT = PACKAGE.parent
HARNESS = ROOT / "recipes" / "harness"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# folder -> folders of this package it may import (itself always allowed); each `__init__` docstring says the same
ALLOWED = {
    "engine": set(),
    "helpers": {"engine"},
    "verification": {"engine"},
    "diagnostics": {"engine", "helpers"},
    "config": {"engine", "helpers"},
    "distributed": {"engine", "helpers", "config"},
    "losses": {"engine", "helpers", "verification", "config", "distributed"},
    "integrations": {"engine", "helpers", "verification", "config", "distributed", "losses"},
    "trainer": {"engine", "helpers", "verification", "config", "distributed", "losses", "integrations"},
}
# The one module of a folder that the folders above it reach it through.
ONLY_DOOR = {"integrations": "hf_gradaccum.integrations.registry"}
# Top-level modules that any folder may import (they import no folder).
BASE_MODULES = {"versions", "assets", "input_checks"}
# third-party packages a folder must not import
FORBIDDEN = {
    "engine": {"transformers", "matplotlib", "trl", "peft"},
    "helpers": {"transformers", "matplotlib"},
    "verification": {"transformers", "matplotlib", "trl", "peft"},
}
MAX_MODULES_PER_FOLDER = 15
MAX_LINES = 600
MAX_EXCUSED = 2


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _imports(path: Path) -> set[str]:
    """Absolute dotted names imported by `path` anywhere in it (functions and `TYPE_CHECKING` blocks included),
    relative imports resolved against the package; `from x import y` gives `x` and `x.y`."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def _package_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def _edges() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package's `__init__` counts as a module)."""
    modules = _package_modules()
    edges = {}
    for name, path in modules.items():
        edges[name] = {
            target for target in _imports(path) if target in modules and target not in (name, "hf_gradaccum")
        }
    return edges


def _folders() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").is_file())


def _may_import_line(init: Path) -> str | None:
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    match = re.search(r"^May import:(.*)$", docstring, re.M)
    return match.group(1) if match else None


def _folder_modules():
    for folder in ALLOWED:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            yield folder, path


@pytest.mark.parametrize(
    ("folder", "path"), list(_folder_modules()), ids=lambda v: str(v).rsplit("hf_gradaccum/", 1)[-1]
)
def test_each_folder_imports_only_the_floors_below_it(folder, path):
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] == "hf_gradaccum" and len(parts) > 1 and parts[1] not in BASE_MODULES and parts[1] != folder:
            target = parts[1]
            if target not in ALLOWED and not (PACKAGE / f"{target}.py").is_file():
                continue  # a name of the package itself (`__version__`)
            assert target in ALLOWED[folder], (
                f"{path.name} ({folder}/) imports {name}; {folder}/ may import {ALLOWED[folder]}"
            )
            door = ONLY_DOOR.get(target)
            if door is not None and len(parts) > 2:
                assert name.startswith(door), (
                    f"{path.name} ({folder}/) imports {name}; {target}/ is reached through {door}"
                )
        assert parts[0] not in FORBIDDEN.get(folder, set()), f"{path.name} ({folder}/) imports {name}"


def test_every_folder_is_a_floor_of_the_layout():
    top = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert top == set(ALLOWED), f"folders without a floor in ALLOWED: {top - set(ALLOWED)}"


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_folder_says_what_lives_there_and_what_it_may_import(folder):
    line = _may_import_line(folder / "__init__.py")
    assert line is not None, f"{folder.relative_to(ROOT)}/__init__.py: its docstring has no 'May import:' line"
    if folder.parent == PACKAGE:
        declared = set(re.findall(r"`(\w+)/`", line))
        assert declared == ALLOWED[folder.name], (
            f"{folder.name}/__init__.py says it may import {sorted(declared)}; the layout allows {sorted(ALLOWED[folder.name])}"
        )


def test_no_import_loops():
    """Tarjan's strongly connected components over every import of the package's modules."""
    edges = _edges()
    index, low, stack, on_stack, loops = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not loops, f"modules that import each other: {loops}"


@pytest.mark.parametrize("folder", [PACKAGE, *_folders()], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_folder_is_a_flat_list_of_more_than_15_modules(folder):
    modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder.relative_to(ROOT)} holds {len(modules)} modules"


def test_long_modules_are_named_in_the_architecture_doc():
    text = ARCHITECTURE.read_text()
    long = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {name: n for name, n in long.items() if n > MAX_LINES}
    unnamed = [f"{name} ({n} lines)" for name, n in long.items() if f"`{name}`" not in text]
    assert not unnamed, f"modules over {MAX_LINES} lines that docs/architecture.md does not name: {unnamed}"
    assert len(long) <= MAX_EXCUSED, f"more than {MAX_EXCUSED} modules over {MAX_LINES} lines: {sorted(long)}"


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


def test_old_module_paths_import_the_moved_modules_names():
    """Every path a module had before the package was laid out in floors still imports, with a warning, and gives
    the names of the modules it moved to (so pickles naming the old path load); no module is loaded twice."""
    code = """
import importlib, sys, warnings
import hf_gradaccum
for old, moved_to in hf_gradaccum._MOVED_MODULES.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"hf_gradaccum.{old}")
    assert any("moved to" in str(w.message) for w in caught), old
    news = [importlib.import_module(f"hf_gradaccum.{name}") for name in moved_to]
    for name in {name for new in news for name in vars(new) if not name.startswith("_")}:
        expected = next(getattr(new, name) for new in news if hasattr(new, name))
        assert getattr(module, name) is expected, (old, name)
files = [getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.startswith("hf_gradaccum")]
files = [f for f in files if f]
assert len(files) == len(set(files)), sorted(f for f in files if files.count(f) > 1)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
