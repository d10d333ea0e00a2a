"""guidellm, vLLM's benchmark tool, against a live `pdcluster serve`: a short synthetic run
with no failed request. guidellm streams with vLLM's `stream_options.continuous_usage_stats`
and reads the usage of every chunk. Its requests, field for field, are also sent in the default
suite (test_gateway_vllm_fields.py, test_guidellm_requests_*), which needs no guidellm.

guidellm is large (it pulls its own torch): it is installed into a venv of its own under the
cache dir (PDCLUSTER_CACHE, default ~/.cache/pdcluster) on first use, and the test skips,
saying why, when that cannot be done (no package index reachable, say).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.benchmarks.targets import free_port
from pdcluster.engine.presets import resolve_model_dir
from tests.cli_utils import serve_command, serve_env, stop_serve, wait_until_serving

MODEL = "preset:tiny-llama"
NUM_REQUESTS = 8
INSTALL_TIMEOUT_S = 1800


def guidellm_binary() -> str:
    """guidellm on PATH, or in the cache's venv (installed there if absent)."""
    found = shutil.which("guidellm")
    if found:
        return found
    cache = Path(os.environ.get("PDCLUSTER_CACHE", Path.home() / ".cache" / "pdcluster"))
    venv = cache / "guidellm-venv"
    binary = venv / "bin" / "guidellm"
    if binary.is_file():
        return str(binary)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "guidellm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        shutil.rmtree(venv, ignore_errors=True)
        detail = getattr(exc, "stderr", None) or exc
        pytest.skip(f"guidellm is not installed and could not be installed into {venv}: {detail}")
    return str(binary)


@pytest.mark.slow
def test_guidellm_benchmarks_with_no_error(tmp_path):
    binary = guidellm_binary()
    port = free_port()
    process = subprocess.Popen(
        serve_command("--model", MODEL, "--prefills", "1", "--decodes", "1", "--port", str(port)),
        env=serve_env(tmp_path),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_until_serving(process, port)
        report = run_guidellm(binary, port, tmp_path)
    finally:
        code, _ = stop_serve(process, signal.SIGTERM)
    assert code == 0
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0
    assert totals["successful"] == NUM_REQUESTS


def run_guidellm(binary: str, port: int, out_dir: Path) -> dict:
    """A synchronous run of NUM_REQUESTS synthetic chat requests; guidellm's JSON report."""
    report = out_dir / "report.json"  # kept in the test's tmp dir
    command = [
        binary, "run",
        "--backend", f"kind=openai_http,target=http://127.0.0.1:{port}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--tokenizer", f"kind=huggingface_auto,model={resolve_model_dir(MODEL)}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text())
