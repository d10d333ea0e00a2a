"""`pdcluster serve --address` against a `ray start --head` cluster with Ray's token
authentication on: it connects with the token from the environment (RAY_AUTH_MODE unset,
as for a user whose ~/.ray/auth_token made `ray start` turn auth on), and without a token
it fails with one line saying what to set."""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_utils import (
    STARTUP_TIMEOUT_S,
    complete,
    serve_command,
    serve_env,
    stop_serve,
    wait_for,
    wait_until_serving,
)
from tests.gateway_utils import free_port

RAY = str(Path(sys.executable).parent / "ray")


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A head node on loopback with token auth on: (GCS port, token, HOME without a token).
    `--block` keeps `ray start` in the foreground: stopping it stops this cluster only."""
    token = secrets.token_hex(16)
    home = tmp_path_factory.mktemp("home")
    port = free_port()
    env = serve_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: _accepts(port), "ray start --head did not come up", STARTUP_TIMEOUT_S)
        yield port, token, home
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)
        wait_for(lambda: not _accepts(port), "the Ray head is still up")


def test_serve_connects_with_the_token_and_sigterm_cleans_up(token_cluster):
    port, token, home = token_cluster
    http_port = free_port()
    command = serve_command(
        "--address", f"127.0.0.1:{port}", "--model", "preset:tiny-llama", "--mixed", "1",
        "--port", str(http_port),
    )  # fmt: skip
    process = subprocess.Popen(
        command, env=serve_env(home, RAY_AUTH_TOKEN=token), stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until_serving(process, http_port)
        assert complete(http_port)
        code, log = stop_serve(process, signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0, log
    assert "token auth: True" in log and "stopped" in log


@pytest.mark.slow  # a second token-auth head: ~25 s; the positive path stays in the default run
def test_serve_without_the_token_is_one_clear_error(token_cluster):
    port, _, home = token_cluster
    command = serve_command("--address", f"127.0.0.1:{port}", "--mixed", "1", "--port", "0")
    result = subprocess.run(
        command, env=serve_env(home), capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot connect to Ray at 127.0.0.1:{port}")
    assert "set RAY_AUTH_TOKEN" in last
