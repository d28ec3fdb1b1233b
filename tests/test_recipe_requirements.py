"""After `pip install .` without the `recipes` extra, a recipe stops with one line naming what to install (exit status
2), not an import traceback; with the packages installed the check lets it through.

How the environment without the extra is made, and why it is real rather than mocked: a fresh virtualenv
(`python -m venv --without-pip`, a second or so) whose site-packages holds a symlink to every entry of this
interpreter's site-packages *except* the distributions `pip install .` does not bring (datasets, evaluate,
matplotlib, scikit-learn, pandas; and TRL, which no extra installs). In it those packages are genuinely absent: no
finder is patched and no stub package shadows them, so `importlib.util.find_spec` answers from the file system as it
would after a real `pip install .`, while torch, transformers, accelerate, pyyaml and tqdm (the core dependencies and
theirs) are the very same files the rest of the suite uses. Installing torch into a fresh virtualenv instead would take
minutes and the network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Top-level names (of import packages, dist-info folders, .libs folders, .pth files) left out of the virtualenv: what
# `pip install .` does not install, plus TRL.
HIDDEN = {"datasets", "evaluate", "matplotlib", "mpl_toolkits", "pylab", "sklearn", "scikit_learn", "pandas", "trl"}
RECIPES_LINE = 'install them with pip install ".[recipes]" from the clone, or pip install'
# recipe -> the one line it prints in that environment
EXPECTED = {
    "finetune_bert": f"finetune_bert.py: error: needs datasets, evaluate, matplotlib (not installed); {RECIPES_LINE} "
    "datasets evaluate matplotlib",
    "finetune_resnet": f"finetune_resnet.py: error: needs datasets, evaluate, matplotlib (not installed); "
    f"{RECIPES_LINE} datasets evaluate matplotlib",
    "plain_accelerate_loop": "plain_accelerate_loop.py: error: needs scikit-learn (not installed); install it with "
    'pip install ".[recipes]" from the clone, or pip install scikit-learn',
    "sft_tiny": "sft_tiny.py: error: needs datasets, trl (not installed); install them with "
    'pip install ".[recipes]" trl from the clone, or pip install datasets trl',
}


def _site_packages() -> list[Path]:
    """This interpreter's site-packages folders, in import order."""
    folders = [Path(p) for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    purelib = Path(sysconfig.get_path("purelib"))
    return folders or [purelib]


def _top_level_name(entry: str) -> str:
    """`scikit_learn-1.9.1.dist-info` -> `scikit_learn`; `pylab.py` -> `pylab`; `matplotlib` -> `matplotlib`."""
    return re.split(r"[-.]", entry, maxsplit=1)[0].lower()


@pytest.fixture(scope="module")
def python_without_extras(tmp_path_factory) -> Path:
    """The interpreter of a fresh virtualenv that has the core dependencies but not the `recipes` extra."""
    venv = tmp_path_factory.mktemp("pip_install_dot") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    target = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    )
    for folder in _site_packages():
        for entry in folder.iterdir():
            link = target / entry.name
            if _top_level_name(entry.name) in HIDDEN or link.exists() or entry.name == "__pycache__":
                continue
            link.symlink_to(entry)
    # The environment is what it claims: the hidden packages are absent, the core ones present.
    probe = "import importlib.util as u; print([n for n in {names} if u.find_spec(n) is None])"
    names = ["datasets", "evaluate", "matplotlib", "sklearn", "pandas", "trl", "torch", "transformers", "yaml"]
    absent = _run(python, "-c", probe.format(names=names)).stdout.strip()
    assert absent == str(["datasets", "evaluate", "matplotlib", "sklearn", "pandas", "trl"]), absent
    return python


def _run(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [str(python), *args], cwd=ROOT, env={**base, **(env or {})}, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_recipe_without_the_extra_says_what_to_install_in_one_line(python_without_extras, recipe):
    proc = _run(python_without_extras, f"recipes/{recipe}.py", "--help")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [EXPECTED[recipe]], proc.stderr  # one line, no traceback
    assert proc.stdout == ""
    assert 'pip install ".[recipes]"' in proc.stderr


def test_the_line_is_printed_once_per_machine_under_a_launch(python_without_extras):
    """Under `accelerate launch` every process runs the check; only `LOCAL_RANK` 0 prints, all exit 2."""
    proc = _run(python_without_extras, "recipes/finetune_bert.py", env={"LOCAL_RANK": "1", "RANK": "1"})
    assert (proc.returncode, proc.stderr) == (2, "")


def test_recipe_that_needs_no_extra_runs_in_that_environment(python_without_extras):
    """The contrastive recipe needs only pyyaml beyond the core (transformers installs it): the check lets it through
    and its `--help` works with datasets, evaluate and matplotlib absent."""
    proc = _run(python_without_extras, "recipes/finetune_contrastive.py", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--output_dir" in proc.stdout


def test_check_passes_through_when_the_packages_are_installed():
    """This interpreter has the extra: the check is silent and `--help` works."""
    proc = _run(Path(sys.executable), "recipes/finetune_bert.py", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--model_name_or_path" in proc.stdout
    assert "needs" not in proc.stderr


def test_arm_progress_is_printed_by_the_first_process_only(tmp_path, capsys, monkeypatch):
    """Under a 2-process launch each process runs every arm (with its own child); the progress lines come from
    `RANK` 0 only, and a failure is still said by the process it happened in (a real child process that crashes)."""
    from harness.arms import plan_arms, run_arms_in_subprocesses

    script = tmp_path / "crash.py"
    script.write_text("raise ValueError('boom')\n")
    (spec,) = plan_arms(["reference"], micro_batch_size=2, gradient_accumulation_steps=2)
    monkeypatch.delenv("MASTER_PORT", raising=False)

    monkeypatch.setenv("RANK", "1")
    run_arms_in_subprocesses([spec], script=script, argv=[], output_dir=tmp_path / "rank1")
    out = capsys.readouterr().out
    assert "=== arm 1/1" not in out
    assert "=== arm reference failed in process 1: ValueError: boom" in out

    monkeypatch.setenv("RANK", "0")
    run_arms_in_subprocesses([spec], script=script, argv=[], output_dir=tmp_path / "rank0")
    out = capsys.readouterr().out
    assert "=== arm 1/1: reference" in out
    assert "=== arm reference failed: ValueError: boom" in out
