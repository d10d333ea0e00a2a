"""Helpers for tests that run `pdcluster serve` (and `ray start`) as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 300.0  # model load and Ray start on a busy 2-core machine
STOP_TIMEOUT_S = 60.0


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "pdcluster.cluster.cli", "serve", *flags]


def serve_env(home: Path, **env: str) -> dict[str, str]:
    """The test's environment with HOME (and so ~/.ray) in `home`, the repository importable,
    and the preset cache and the built CPU kernels shared across the session; `env` on top
    (RAY_AUTH_* included)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    cache = os.environ.get("PDCLUSTER_CACHE", str(Path.home() / ".cache" / "pdcluster"))
    kernels = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions"))
    base.update(
        HOME=str(home), PYTHONPATH=str(REPO), PDCLUSTER_CACHE=cache, TORCH_EXTENSIONS_DIR=kernels
    )
    return {**base, **env}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.1)


def wait_until_serving(process: subprocess.Popen, port: int) -> list[dict]:
    """Until GET /health answers 200 on 127.0.0.1:port (fails early if the process exits);
    the bodies of the answers before it (503s while starting)."""
    before: list[dict] = []

    def serving() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"serve exited {process.returncode}: {process.stderr.read()}")
        try:
            response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        except httpx.HTTPError:
            return False  # not listening yet
        if response.status_code != 200:
            assert response.status_code == 503, response.text
            before.append(response.json())
        return response.status_code == 200

    wait_for(serving, "serve did not start", STARTUP_TIMEOUT_S)
    return before


def stop_serve(process: subprocess.Popen, sig: signal.Signals) -> tuple[int, str]:
    """Send `sig`; returns the exit code and everything the process wrote to stderr."""
    process.send_signal(sig)
    _, err = process.communicate(timeout=STOP_TIMEOUT_S)
    return process.returncode, err


def complete(port: int) -> str:
    """One completion from a serve on `port`; its text."""
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
        names[int(entry.name)] = name
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, names[child]))
            todo.append(child)
    return found
