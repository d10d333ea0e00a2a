"""A cluster that survives its head's GCS: a real `redis-server` backs a real `ray start
--head` (GCS fault tolerance, as KubeRay's `gcsFaultToleranceOptions` sets it up), `pdcluster
serve --address` runs 1P1D on it, and the GCS process is killed with SIGKILL under 32 streams,
then started again with its own command line (as KubeRay restarts a head). Checked:

- every stream ends complete (none fails, none stops short), the GCS down or not,
- requests sent while the GCS is down are served by the live instances (the gateway plans
  without the GCS, and an instance never waits on the GCS for a peer it knows),
- once the GCS is back, scaling works again and the new instance serves.

This cluster is its own, beside the session's: separate ports, temp dir and processes.
`.ci/run` installs redis-server; elsewhere the test skips when it is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REDIS = shutil.which("redis-server")
NUM_STREAMS = 32
MAX_TOKENS = 256
OUTAGE_S = 8.0
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Head:
    """redis-server, `ray start --head` backed by it, and `pdcluster serve --address`."""

    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.redis_port, self.gcs_port, self.http_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env = env | {
            "RAY_REDIS_ADDRESS": f"127.0.0.1:{self.redis_port}",
            "RAY_external_storage_namespace": Path(temp_dir).name,
            # Ray's raylets give up on a GCS after this (60 s by default): docs/deployment.md
            "RAY_gcs_rpc_server_reconnect_timeout_s": "300",
        }
        self.processes: list[subprocess.Popen] = []
        self.serve: subprocess.Popen | None = None
        self.model = ""  # the id it serves

    def spawn(self, argv: list[str], log: str, **kwargs) -> subprocess.Popen:
        out = open(Path(self.temp_dir) / log, "ab")  # noqa: SIM115 - the process owns it
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )
        self.processes.append(process)
        return process

    def start(self) -> None:
        self.spawn(
            [REDIS, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""],
            "redis.log",
        )
        bin_dir = Path(sys.executable).parent
        subprocess.run(
            [bin_dir / "ray", "start", "--head", "--node-ip-address", "127.0.0.1",
             "--port", str(self.gcs_port), "--num-cpus", "4", "--include-dashboard=false",
             "--temp-dir", self.temp_dir, "--disable-usage-stats"],
            env=self.env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        # The gateway's environment has no reconnect timeout: pdcluster sets its own.
        serve_env = {k: v for k, v in self.env.items() if "reconnect" not in k}
        self.serve = self.spawn(
            [bin_dir / "pdcluster", "serve", "--address", f"127.0.0.1:{self.gcs_port}",
             "--model", "preset:tiny-llama", "--prefills", "1", "--decodes", "1",
             "--port", str(self.http_port)],
            "serve.log", env=serve_env,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while not self.healthy():
            assert self.serve.poll() is None, self.log("serve.log")
            assert time.monotonic() < deadline, self.log("serve.log")
            time.sleep(1)
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def kill_gcs(self) -> tuple[list[str], dict[str, str], str]:
        """SIGKILL the GCS; its command line, environment and working directory."""
        (pid,) = [p for p in self.pids() if _read(f"/proc/{p}/comm").strip() == "gcs_server"]
        argv = _read(f"/proc/{pid}/cmdline").split("\0")[:-1]
        env = dict(
            kv.split("=", 1) for kv in _read(f"/proc/{pid}/environ").split("\0") if "=" in kv
        )
        cwd = os.readlink(f"/proc/{pid}/cwd")
        os.kill(pid, signal.SIGKILL)
        return argv, env, cwd

    def pids(self) -> list[int]:
        """Every process of this cluster (their command lines name its temp dir)."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if self.temp_dir in _read(f"/proc/{entry}/cmdline"):
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def log(self, name: str) -> str:
        return (Path(self.temp_dir) / name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            os.killpg(self.serve.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.serve.wait(30)
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


@pytest.fixture
def head() -> Iterator[Head]:
    temp_dir = tempfile.mkdtemp(prefix="pdc-gcs-", dir="/tmp")  # Ray's socket paths are short
    head = Head(temp_dir)
    try:
        head.start()
        yield head
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


async def stream(client: httpx.AsyncClient, head: Head, i: int, chunks: list[int]) -> int | str:
    """One streamed completion, counting its chunks in `chunks[i]`: its tokens (the usage
    of its last chunk) or what went wrong."""
    body = {"model": head.model, "prompt": f"Stream {i}: once upon a time",
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens: int | str = "no usage"
    async with client.stream("POST", f"{head.url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return tokens
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"error {chunk['error']}"
                chunks[i] += 1
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return "ended without [DONE]"


async def complete(client: httpx.AsyncClient, head: Head, i: int) -> int:
    """A non-streamed completion's tokens (an HTTP error raises)."""
    body = {"model": head.model, "prompt": f"Request {i} of the outage",
            "max_tokens": 8, "ignore_eos": True, "temperature": 0}  # fmt: skip
    response = await client.post(f"{head.url}/v1/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


async def until_reachable(client: httpx.AsyncClient, head: Head, timeout_s: float = 60) -> bool:
    """Until /v1/cluster says the GCS answers again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await client.get(f"{head.url}/v1/cluster")).json()["gcs"]["reachable"]:
            return True
        await asyncio.sleep(0.5)
    return False


def test_streams_and_new_requests_survive_the_gcs_and_scaling_works_after_it(head):
    async def scenario() -> dict:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            chunks = [0] * NUM_STREAMS
            streams = [
                asyncio.ensure_future(stream(client, head, i, chunks)) for i in range(NUM_STREAMS)
            ]
            while min(chunks) < 2 and not all(s.done() for s in streams):
                await asyncio.sleep(0.05)
            argv, env, cwd = head.kill_gcs()
            running = sum(not s.done() for s in streams)
            during = await asyncio.gather(*(complete(client, head, i) for i in range(8)))
            view_down = (await client.get(f"{head.url}/v1/cluster")).json()
            await asyncio.sleep(max(0.0, OUTAGE_S - 1))
            head.spawn(argv, "gcs_restart.log", env=env, cwd=cwd)
            ends = await asyncio.gather(*streams)
            gcs_back = await until_reachable(client, head)
            after = await asyncio.gather(*(complete(client, head, 8 + i) for i in range(8)))
            scaled = await client.post(
                f"{head.url}/v1/admin/scale", json={"role": "decode", "count": 2}, timeout=240
            )
            return dict(running=running, ends=ends, during=during, after=after, scaled=scaled,
                        view_down=view_down, gcs_back=gcs_back)  # fmt: skip

    result = asyncio.run(scenario())
    assert result["running"] == NUM_STREAMS, "streams ended before the GCS was killed"
    assert result["ends"] == [MAX_TOKENS] * NUM_STREAMS, (result["ends"], head.log("serve.log"))
    assert result["during"] == [8] * 8  # served while the GCS was down
    assert result["view_down"]["gcs"] == {"reachable": False}
    assert all(i["healthy"] for i in result["view_down"]["instances"])
    assert result["gcs_back"]
    assert result["after"] == [8] * 8
    assert result["scaled"].status_code == 200, result["scaled"].text
    assert result["scaled"].json()["count"] == 2
    assert head.healthy()
