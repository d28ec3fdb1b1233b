"""Run a worker on 2 real CPU processes with `accelerate launch` (gloo). A fresh launcher process per test: forking
the pytest process after torch has started its thread pool can deadlock the children."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    *args: str,
    script: str = "tests/workers/run_ddp.py",
    timeout: int = 300,
    config: str = "configs/accelerate/cpu_2proc.yaml",
    env: dict[str, str] | None = None,
    num_processes: int | None = None,
) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file config script *args` from the repository root, with `env` added to this
    process's environment (and `--num_processes` when given); fail with its output unless it exits 0."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    cmd += ["--main_process_port", str(free_port()), script, *args]
    full_env = None if env is None else {**os.environ, **env}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `python script *args` from the repository root in a fresh process; fail with its output unless it
    exits 0."""
    cmd = [sys.executable, script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc
