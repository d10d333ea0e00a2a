"""What the front costs: CPU per streamed token of every process that is not an instance.

Starts `pdcluster serve` (embedded Ray) as a subprocess, streams a closed-loop load through
its gateway, and reads the CPU time of every process of the serve tree from /proc before
and after. Processes are grouped by what they run: `instance` (the E/P/D actors), `front`
(the serving process and every other actor: gateway replicas, a router, the pool controller),
`ray` (Ray's own daemons and idle workers). Also the TTFT and the first-to-second token gap
at concurrency 1 and 16, the idle cluster's CPU (% of one core per group, over `--idle-s`
with no request), the instances' pulls per second when idle and under load (from their
`num_pulls` stat, where the checkout has it), and each instance process's memory (PSS).
`--checkout DIR` runs another checkout's serve (e.g. the commit before a change) with this
same client, so both sides are measured the same way:

    python -m benchmarks.front_cost --checkout /tmp/before --label before --label after

prints one table per side and the ratios after ÷ before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.targets import REPO_ROOT, free_port

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
STREAM_TIMEOUT_S = 300.0  # a stream silent this long is lost
RAY_DAEMONS = (
    "raylet",
    "gcs_server",
    "dashboard",
    "log_monitor",
    "monitor.py",
    "agent",
    "ray::idle",
    "runtime_env",
    "default_worker.py",
)  # fmt: skip; lower case


@dataclass
class Side:
    label: str
    cpu_ms: dict[str, float]  # group -> CPU ms during the load
    tokens: int
    latency: dict[str, float]  # e.g. ttft_p50_ms_c1
    num_requests: int = 0  # of the load
    idle_pct: dict[str, float] = field(default_factory=dict)  # group -> % of one core, idle
    pulls_per_s: dict[str, float | None] = field(default_factory=dict)  # "idle", "load"
    instance_pss_mb: list[float] = field(default_factory=list)
    num_instances: int = 0
    load_s: float = 0.0  # wall time of the load
    num_lost: int = 0  # streams of the load that went silent (see `_one`)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.load_s, 1e-9)

    def front_us_per_pull(self) -> float | None:
        """The front's CPU per pull answered under load (every replica's pulls)."""
        pulls_per_s = self.pulls_per_s.get("load")
        if not pulls_per_s:
            return None
        return self.cpu_ms.get("front", 0.0) * 1000 / (pulls_per_s * self.load_s)

    def per_1k(self, group: str) -> float:
        return self.cpu_ms.get(group, 0.0) * 1000 / max(self.tokens, 1)

    def per_request(self, group: str) -> float:
        return self.cpu_ms.get(group, 0.0) / max(self.num_requests, 1)


# ---- /proc ---------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _tree(root: int) -> list[int]:
    tree, todo, seen = _children(), [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += tree.get(pid, [])
    return seen


def _cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    except (OSError, IndexError, ValueError):
        return None


def _group(pid: int, root: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if pid == root:
        return "front"  # the serving process: gateway replica 0
    if "InstanceActor" in cmdline:
        return "instance"
    if cmdline.startswith("ray::"):
        return "ray" if any(d in cmdline.lower() for d in RAY_DAEMONS) else "front"
    return "ray"


def _pss_mb(pid: int) -> float | None:
    """Proportional set size: shared pages (torch, Ray's libraries) split among sharers."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def instance_pss_mb(root: int) -> list[float]:
    pids = [p for p in _tree(root) if _group(p, root) == "instance"]
    return [m for m in map(_pss_mb, pids) if m is not None]


def snapshot(root: int) -> dict[int, tuple[str, float]]:
    out = {}
    for pid in _tree(root):
        cpu = _cpu_s(pid)
        if cpu is not None:
            out[pid] = (_group(pid, root), cpu)
    return out


def cpu_ms_between(before: dict, after: dict) -> dict[str, float]:
    groups: dict[str, float] = {}
    for pid, (group, cpu) in after.items():
        start = before.get(pid, (group, 0.0))[1]
        groups[group] = groups.get(group, 0.0) + (cpu - start) * 1000
    return groups


# ---- load ----------------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[float]]:
    """Streamed tokens and the arrival time of each content chunk (from the send); -1 tokens
    for a stream that went silent for the client's timeout. A kept-alive connection that the
    server closed as the request went out is retried once on a new one."""
    try:
        return await _stream_one(client, url, body)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return await _stream_one(client, url, body)
    except httpx.ReadTimeout:  # a stream that stopped: lost, counted (`Side.num_lost`)
        return -1, []


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[float]]:
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - start)
    return tokens, arrivals


async def run_load(
    url: str, model: str, concurrency: int, requests_each: int, max_tokens: int,
    timeout_s: float = STREAM_TIMEOUT_S,
) -> tuple[int, list[list[float]], int]:  # fmt: skip
    """(tokens streamed, each stream's chunk arrivals, streams lost)."""
    body = {"model": model, "prompt": "Tell me about the sea and the ships on it",
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def worker() -> list[tuple[int, list[float]]]:
            return [await _one(client, url, body) for _ in range(requests_each)]

        results = [r for rs in await asyncio.gather(*(worker() for _ in range(concurrency)))
                   for r in rs]  # fmt: skip
    lost = sum(t < 0 for t, _ in results)
    return sum(max(t, 0) for t, _ in results), [a for _, a in results], lost


def _latency(arrivals: list[list[float]], concurrency: int) -> dict[str, float]:
    ttft = [a[0] for a in arrivals if a]
    gap = [a[1] - a[0] for a in arrivals if len(a) > 1]
    return {
        f"ttft_p50_ms_c{concurrency}": statistics.median(ttft) * 1000,
        f"gap12_p50_ms_c{concurrency}": statistics.median(gap) * 1000,
    }


def num_pulls(url: str) -> tuple[int, int | None]:
    """(instances, pulls they answered so far; None when the checkout does not count them)."""
    rows = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instances"]
    counts = [r.get("num_pulls") for r in rows]
    return len(rows), None if None in counts else sum(counts)


def _rate(before: int | None, after: int | None, seconds: float) -> float | None:
    return None if before is None or after is None else (after - before) / seconds


def measure_idle(
    url: str, root: int, idle_s: float, settle_s: float
) -> tuple[dict[str, float], float | None]:
    """% of one core per group, and pulls per second, over `idle_s` with no request, after
    `settle_s` for the last requests' after-effects (reaping, stats) to pass."""
    time.sleep(settle_s)
    _, pulls_before = num_pulls(url)
    before, start = snapshot(root), time.monotonic()
    time.sleep(idle_s)
    after, elapsed = snapshot(root), time.monotonic() - start
    _, pulls_after = num_pulls(url)
    pct = {g: ms / elapsed / 10 for g, ms in cpu_ms_between(before, after).items()}
    return pct, _rate(pulls_before, pulls_after, elapsed)


# ---- one side --------------------------------------------------------------------------------
def measure(checkout: Path, label: str, args: argparse.Namespace) -> Side:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--config", args.config,
           "--port", str(port)]  # fmt: skip
    log = open(f"/tmp/front_cost-{label}.log", "wb")  # noqa: SIM115 - the server's, while it runs
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        model = _wait_ready(url, proc, args.ready_timeout_s)
        asyncio.run(run_load(url, model, 4, 2, 8))  # warm up every path
        latency = {}
        for concurrency in (1, 16):
            _, arrivals, _ = asyncio.run(run_load(url, model, concurrency, 3, 16))
            latency.update(_latency(arrivals, concurrency))
        idle_pct, idle_pulls = measure_idle(url, proc.pid, args.idle_s, args.idle_settle_s)
        num_instances, pulls_before = num_pulls(url)
        spy = _py_spy(proc.pid, args.py_spy, label)
        before, start = snapshot(proc.pid), time.monotonic()
        tokens, _, lost = asyncio.run(
            run_load(url, model, args.concurrency, args.requests_each, args.max_tokens,
                     args.stream_timeout_s)
        )  # fmt: skip
        after, elapsed = snapshot(proc.pid), time.monotonic() - start
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile and exits
            spy.wait(timeout=60)
        _, pulls_after = num_pulls(url)
        side = Side(label, cpu_ms_between(before, after), tokens, latency)
        side.num_requests = args.concurrency * args.requests_each
        side.idle_pct = idle_pct
        side.pulls_per_s = {"idle": idle_pulls, "load": _rate(pulls_before, pulls_after, elapsed)}
        side.instance_pss_mb = instance_pss_mb(proc.pid)
        side.num_instances = num_instances
        side.load_s = elapsed
        side.num_lost = lost
        return side
    finally:
        _stop(proc)
        log.close()


def _py_spy(pid: int, out: str | None, label: str) -> subprocess.Popen | None:
    """py-spy sampling the serving process (gateway replica 0) into `out`-LABEL.txt, as
    collapsed stacks (one `frame;frame;... count` a line); its own CPU is not in the tree."""
    if out is None:
        return None
    cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
           "--format", "raw", "--rate", "50", "--nonblocking", "--output", f"{out}-{label}.txt"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C the serve process group (it shuts its cluster down); kill what is left."""
    os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, ValueError):
            time.sleep(0.5)
    raise TimeoutError("the gateway did not come up")


def report(sides: list[Side]) -> str:
    groups = ("front", "instance", "ray")
    lines = ["| side | tokens | " + " | ".join(f"{g} ms/1k tok" for g in groups)
             + " | all ms/1k tok | " + " | ".join(sides[0].latency) + " |"]  # fmt: skip
    lines.append("|" + "---|" * (3 + len(groups) + len(sides[0].latency)))
    for s in sides:
        total = sum(s.per_1k(g) for g in s.cpu_ms if g != "gone")
        cells = [s.label, str(s.tokens), *(f"{s.per_1k(g):.0f}" for g in groups), f"{total:.0f}",
                 *(f"{v:.1f}" for v in s.latency.values())]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| side | instances | idle % of a core: " + " / ".join(groups)
              + " | pulls/s idle | pulls/s load | tokens/s | tokens/pull | front µs/pull"
              " | front ms/request | PSS MB/instance | streams lost |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in sides:
        idle = " / ".join(f"{s.idle_pct.get(g, 0.0):.1f}" for g in groups)
        pulls = [f"{v:.0f}" if v is not None else "n/a" for v in s.pulls_per_s.values()]
        load_pulls, per_pull = s.pulls_per_s.get("load"), s.front_us_per_pull()
        per_token = f"{s.tokens_per_s / load_pulls:.1f}" if load_pulls else "n/a"
        pss = statistics.mean(s.instance_pss_mb) if s.instance_pss_mb else 0.0
        lines.append(f"| {s.label} | {s.num_instances} | {idle} | {' | '.join(pulls)} | "
                     f"{s.tokens_per_s:.0f} | {per_token} | "
                     f"{'n/a' if per_pull is None else f'{per_pull:.0f}'} | "
                     f"{s.per_request('front'):.1f} | {pss:.0f} | {s.num_lost} |")  # fmt: skip
    if len(sides) == 2:
        old, new = sides
        ratio = new.per_1k("front") / max(old.per_1k("front"), 1e-9)
        total_old = sum(old.per_1k(g) for g in old.cpu_ms if g != "gone")
        total_new = sum(new.per_1k(g) for g in new.cpu_ms if g != "gone")
        lines.append(f"\nfront {new.label} ÷ {old.label}: {ratio:.2f}; all processes: "
                     f"{total_new / max(total_old, 1e-9):.2f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="ray_configs/local-1p1d.yaml")
    parser.add_argument("--checkout", type=Path, default=None,
                        help="measure this checkout too, first (e.g. the commit before)")  # fmt: skip
    parser.add_argument("--label", action="append", default=None,
                        help="side names, in order (default: other, this)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-each", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--stream-timeout-s", type=float, default=STREAM_TIMEOUT_S,
                        help="a load stream silent this long counts as lost")  # fmt: skip
    parser.add_argument("--py-spy", default=None, metavar="PREFIX",
                        help="profile the serving process under load into PREFIX-LABEL.txt")  # fmt: skip
    parser.add_argument("--idle-settle-s", type=float, default=10.0,
                        help="seconds between the last request and the idle measurement")  # fmt: skip
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="seconds of no load over which the idle CPU is measured")  # fmt: skip
    args = parser.parse_args(argv)
    checkouts = ([args.checkout] if args.checkout else []) + [REPO_ROOT]
    labels = args.label or ["other", "this"][-len(checkouts) :]
    sides = [measure(c.resolve(), label, args) for c, label in zip(checkouts, labels)]
    print(report(sides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
