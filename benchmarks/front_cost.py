"""What the front costs: CPU per streamed token of every process that is not an instance.

Starts `pdcluster serve` (embedded Ray) as a subprocess, streams a closed-loop load through
its gateway, and reads the CPU time of every process of the serve tree from /proc before
and after. Processes are grouped by what they run: `instance` (the E/P/D actors), `front`
(the gateway replicas: the serving process and its `GatewayReplica` actors), `control` (every
other actor: the pool controller, the KV pool's owner), `ray` (Ray's own daemons and idle
workers). Also the TTFT and the first-to-second token gap
at concurrency 1 and 16, the idle cluster's CPU (% of one core per group, over `--idle-s`
with no request; and the same for pdcluster's own threads alone, without Ray's), the instances' pulls per second when idle and under load (from their
`num_pulls` stat, where the checkout has it), and each instance process's memory (PSS).
`--checkout DIR` runs another checkout's serve (e.g. the commit before a change) with this
same client, so both sides are measured the same way:

    python -m pdcluster.benchmarks.front_cost --checkout /tmp/before --label before --label after

prints one table per side and the ratios after ÷ before.

`--trace` draws the load's requests (prompt and output lengths) from a trace instead of one
fixed prompt, and the run then checks what a scale run must show (benchmarks/configs/
scale-32.yaml): every request streamed exactly the tokens it asked for, the peak of streams
open at once, every instance back to all blocks free with nothing held, the simulator's
overrun share and tokens per second in modeled time, the planner's round time, and how long
the cluster took to come up:

    python -m pdcluster.benchmarks.front_cost --config benchmarks/configs/scale-32.yaml --trace \
        --concurrency 1024 --requests-each 1 --token-scale 0.25 --json /tmp/scale-32.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdcluster.benchmarks.metrics import percentile
from pdcluster.benchmarks.targets import REPO_ROOT, Target, free_port, url_target
from pdcluster.benchmarks.workload import LengthScaling, default_trace, request_body, trace_workload

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
    idle_own_pct: dict[str, float] = field(default_factory=dict)  # the same, own threads only
    pulls_per_s: dict[str, float | None] = field(default_factory=dict)  # "idle", "load"
    instance_pss_mb: list[float] = field(default_factory=list)
    front_pss_mb: list[float] = field(default_factory=list)  # each front process, after the load
    num_instances: int = 0
    ready_s: float = 0.0  # serve started -> the gateway answers (every instance up)
    loadavg: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # by phase
    checks: dict[str, Any] = field(default_factory=dict)  # of a --trace load: scale_checks
    load_s: float = 0.0  # wall time of the load
    load_latency: dict[str, float] = field(default_factory=dict)  # of the load's streams
    num_lost: int = 0  # streams of the load that failed or went silent (`Load.errors`)

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


def _cpu_s(pid: int, stat: str = "stat") -> float | None:
    """User + system CPU seconds of a process (`stat`) or of one of its threads
    (`task/TID/stat`)."""
    try:
        fields = Path(f"/proc/{pid}/{stat}").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    except (OSError, IndexError, ValueError):
        return None


def _own_threads_cpu_s(pid: int, root: int) -> float:
    """CPU seconds of the threads of a process that run pdcluster's loops: those named as the
    process (a thread inherits its creator's name, and Ray names the threads of its C++ core),
    less an actor process's main thread, Ray's task loop, which wakes every 10 ms whatever the
    actor does (Ray's per-process floor, benchmarks/idle_floor.py). An upper bound: a Python
    thread of Ray's own counts too."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text()
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0.0
    own = 0.0
    for tid in tids:
        if tid == pid and pid != root:
            continue
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text() == name:
                own += _cpu_s(pid, f"task/{tid}/stat") or 0.0
    return own


def _group(pid: int, root: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if pid == root or "GatewayReplica" in cmdline:
        return "front"  # the gateway replicas: the serving process is replica 0
    if "InstanceActor" in cmdline:
        return "instance"
    if cmdline.startswith("ray::"):
        return "ray" if any(d in cmdline.lower() for d in RAY_DAEMONS) else "control"
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


def group_pss_mb(root: int, group: str) -> list[float]:
    """PSS of each process of `group` in the serve tree."""
    pids = [p for p in _tree(root) if _group(p, root) == group]
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
@dataclass
class Load:
    """What one closed-loop load streamed."""

    num_requests: int
    tokens: int = 0
    arrivals: list[list[float]] = field(default_factory=list)  # per request, from its send
    num_complete: int = 0  # requests that streamed exactly the `max_tokens` they asked for
    errors: list[str] = field(default_factory=list)
    open_streams: int = 0  # requests with a response open now
    peak_streams: int = 0  # ... at most, over the load
    wall_s: float = 0.0


async def _one(client: httpx.AsyncClient, url: str, body: dict, load: Load) -> None:
    """Stream one request into `load`. A kept-alive connection that the server closed as the
    request went out is retried once on a new one; other failures are recorded."""
    arrivals: list[float] = []
    try:
        try:
            tokens = await _stream_one(client, url, body, load, arrivals)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if arrivals:
                raise
            tokens = await _stream_one(client, url, body, load, arrivals)
    except httpx.HTTPError as exc:
        load.errors.append(f"{type(exc).__name__}: {exc}")
        return
    load.tokens += tokens
    load.arrivals.append(arrivals)
    load.num_complete += tokens == body["max_tokens"]


async def _stream_one(
    client: httpx.AsyncClient, url: str, body: dict, load: Load, arrivals: list[float]
) -> int:
    """Streamed tokens (from the usage chunk); each content chunk's arrival time (from the
    send) goes to `arrivals`."""
    start = time.perf_counter()
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        load.open_streams += 1
        load.peak_streams = max(load.peak_streams, load.open_streams)
        try:  # only the chunks that can end the stream are decoded: the client stays cheap
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"usage":{' not in line and '"finish_reason":"error"' not in line:
                    if '"text":""' not in line:
                        arrivals.append(time.perf_counter() - start)
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason") == "error":
                        load.errors.append(choice.get("error") or "the request failed")
                    if choice.get("text"):
                        arrivals.append(time.perf_counter() - start)
        finally:
            load.open_streams -= 1
    return tokens


async def run_load(url: str, bodies: list[dict], concurrency: int, timeout_s: float) -> Load:
    """Closed loop: `concurrency` clients, each sending the next of `bodies` once its last
    answer ended. `timeout_s`: the longest wait for any byte of an answer."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    load, todo = Load(len(bodies)), iter(bodies)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def client_loop() -> None:
            for body in todo:  # shared: each client takes the next body
                await _one(client, url, body, load)

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    load.wall_s = time.perf_counter() - start
    return load


def fixed_bodies(model: str, num: int, max_tokens: int) -> list[dict]:
    body = {"model": model, "prompt": "Tell me about the sea and the ships on it",
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return [body] * num


def trace_bodies(args: argparse.Namespace, target: Target, num: int) -> list[dict]:
    """`num` streaming bodies with the prompt and output lengths of the trace's requests
    from `--window-start-s` (random prompt token ids, `ignore_eos`: exact lengths)."""
    lengths = LengthScaling(
        args.token_scale, max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len
    )
    workload = trace_workload(args.trace, lengths, args.window_start_s, num)
    rng = random.Random(args.seed)
    specs = workload.fit(target.max_model_len).requests
    return [request_body(spec, target.model, rng)[1] for spec in specs]


def _latency(arrivals: list[list[float]], concurrency: int) -> dict[str, float]:
    ttft = [a[0] for a in arrivals if a]
    gap = [a[1] - a[0] for a in arrivals if len(a) > 1]
    return {
        f"ttft_p50_ms_c{concurrency}": statistics.median(ttft) * 1000,
        f"gap12_p50_ms_c{concurrency}": statistics.median(gap) * 1000,
    }


def load_latency(arrivals: list[list[float]]) -> dict[str, float]:
    """TTFT and the gap between a stream's events (ms), p50 and p99 over the load."""
    ttft = [a[0] for a in arrivals if a]
    gaps = [b - a for events in arrivals for a, b in zip(events, events[1:])]
    return {f"{name}_p{q}": (percentile(values, q) or 0.0) * 1000
            for name, values in (("ttft", ttft), ("gap", gaps)) for q in (50, 99)}  # fmt: skip


def num_pulls(url: str) -> tuple[int, int | None]:
    """(instances, pulls they answered so far; None when the checkout does not count them)."""
    rows = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instances"]
    counts = [r.get("num_pulls") for r in rows]
    return len(rows), None if None in counts else sum(counts)


def _rate(before: int | None, after: int | None, seconds: float) -> float | None:
    return None if before is None or after is None else (after - before) / seconds


def own_snapshot(root: int) -> dict[int, tuple[str, float]]:
    """`snapshot`, counting only each process's own threads (`_own_threads_cpu_s`)."""
    return {
        pid: (_group(pid, root), _own_threads_cpu_s(pid, root))
        for pid in _tree(root)
        if _group(pid, root) != "ray"
    }


def measure_idle(
    url: str, root: int, idle_s: float, settle_s: float
) -> tuple[dict[str, float], dict[str, float], float | None]:
    """% of one core per group, the same for pdcluster's own threads alone, and pulls per
    second, over `idle_s` with no request, after `settle_s` for the last requests'
    after-effects (reaping, stats) to pass."""
    time.sleep(settle_s)
    _, pulls_before = num_pulls(url)
    before, own_before, start = snapshot(root), own_snapshot(root), time.monotonic()
    time.sleep(idle_s)
    after, own_after, elapsed = snapshot(root), own_snapshot(root), time.monotonic() - start
    _, pulls_after = num_pulls(url)
    pct = {g: ms / elapsed / 10 for g, ms in cpu_ms_between(before, after).items()}
    own = {g: ms / elapsed / 10 for g, ms in cpu_ms_between(own_before, own_after).items()}
    return pct, own, _rate(pulls_before, pulls_after, elapsed)


# ---- after a load: what a scale run must show ---------------------------------------------
HELD_KEYS = ("num_running", "num_waiting", "num_deferred", "num_pending_transfers", "num_streams")


def cluster_view(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/v1/cluster", timeout=60).json()["instances"]


def settle(url: str, timeout_s: float) -> tuple[list[dict[str, Any]], float | None]:
    """Wait until every instance holds nothing (all blocks free, no request, stream or
    transfer); the last view, and the seconds that took (None: not within `timeout_s`)."""
    start = time.monotonic()
    while True:
        view = cluster_view(url)
        if all(_holds_nothing(i) for i in view):
            return view, time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return view, None
        time.sleep(0.5)


def _holds_nothing(instance: dict[str, Any]) -> bool:
    free = instance["num_blocks_free"] == instance["num_blocks_total"]
    return free and instance["reachable"] and not any(instance.get(k) for k in HELD_KEYS)


def sim_steps(view: list[dict[str, Any]]) -> tuple[int, int]:
    """(modeled steps, steps that overran their modeled time) over every instance."""
    return (sum(i.get("sim_steps", 0) for i in view),
            sum(i.get("sim_steps_overrun", 0) for i in view))  # fmt: skip


def planner_round_s(url: str) -> float | None:
    """The planner's last round time (None: no planner has run a round)."""
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("pdcluster_planner_round_seconds "):
            return float(line.split()[1])
    return None


def scale_checks(
    url: str, load: Load, view_before: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """Completeness, leaks and the simulator's figures of the load that just ran."""
    view, settle_s = settle(url, args.settle_timeout_s)
    steps = [a - b for a, b in zip(sim_steps(view), sim_steps(view_before))]
    time_scale = max((i.get("sim_time_scale", 0.0) for i in view), default=0.0)
    return {
        "num_requests": load.num_requests,
        "num_complete": load.num_complete,
        "num_errors": len(load.errors),
        "errors_first": load.errors[:5],
        "peak_streams": load.peak_streams,
        "wall_s": load.wall_s,
        "tokens_per_s_wall": load.tokens / max(load.wall_s, 1e-9),
        "sim_time_scale": time_scale or None,
        "tokens_per_s_modeled": load.tokens * time_scale / max(load.wall_s, 1e-9) or None,
        "sim_steps": steps[0],
        "sim_overrun_share": steps[1] / steps[0] if steps[0] else None,
        "all_blocks_free": settle_s is not None,
        "settle_s": settle_s,
        "instances_holding": [i["id"] for i in view if not _holds_nothing(i)],
        "planner_round_s": planner_round_s(url),
    }


# ---- one side --------------------------------------------------------------------------------
def measure(
    checkout: Path, label: str, args: argparse.Namespace, serve_args: tuple[str, ...] = ()
) -> Side:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--config", args.config,
           "--port", str(port), *serve_args]  # fmt: skip
    log = open(f"/tmp/front_cost-{label}.log", "wb")  # noqa: SIM115 - the server's, while it runs
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    timeout_s = args.stream_timeout_s
    try:
        target = _wait_ready(url, proc, args.ready_timeout_s)
        ready_s = time.monotonic() - started
        model = target.model
        asyncio.run(run_load(url, fixed_bodies(model, 8, 8), 4, timeout_s))  # warm up every path
        latency = {}
        for concurrency in (1, 16):
            probe = asyncio.run(run_load(url, fixed_bodies(model, 3 * concurrency, 16),
                                         concurrency, timeout_s))  # fmt: skip
            latency.update(_latency(probe.arrivals, concurrency))
        loadavg = {"idle": os.getloadavg()}
        idle = measure_idle(url, proc.pid, args.idle_s, args.idle_settle_s)
        idle_pct, idle_own_pct, idle_pulls = idle
        num_instances, pulls_before = num_pulls(url)
        num = args.concurrency * args.requests_each
        bodies = (trace_bodies(args, target, num) if args.trace
                  else fixed_bodies(model, num, args.max_tokens))  # fmt: skip
        view_before = cluster_view(url)
        spy = _py_spy(proc.pid, args.py_spy, label)
        loadavg["load_start"] = os.getloadavg()
        before = snapshot(proc.pid)
        load = asyncio.run(run_load(url, bodies, args.concurrency, timeout_s))
        after = snapshot(proc.pid)
        loadavg["load_end"] = os.getloadavg()
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile and exits
            spy.wait(timeout=60)
        _, pulls_after = num_pulls(url)
        side = Side(label, cpu_ms_between(before, after), load.tokens, latency)
        side.num_requests = load.num_requests
        side.idle_pct = idle_pct
        side.idle_own_pct = idle_own_pct
        side.pulls_per_s = {
            "idle": idle_pulls,
            "load": _rate(pulls_before, pulls_after, load.wall_s),
        }
        side.instance_pss_mb = group_pss_mb(proc.pid, "instance")
        side.front_pss_mb = group_pss_mb(proc.pid, "front")
        side.num_instances = num_instances
        side.load_s = load.wall_s
        side.load_latency = load_latency(load.arrivals)
        side.num_lost = len(load.errors)
        side.ready_s = ready_s
        side.loadavg = loadavg
        if args.trace:
            side.checks = scale_checks(url, load, view_before, args)
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
    with contextlib.suppress(ProcessLookupError):  # it exited already (e.g. a failed start)
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> Target:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            return url_target(url)
        except ValueError:
            time.sleep(0.5)
    raise TimeoutError("the gateway did not come up")


def report(sides: list[Side]) -> str:
    groups = ("front", "control", "instance", "ray")
    lines = ["| side | tokens | " + " | ".join(f"{g} ms/1k tok" for g in groups)
             + " | all ms/1k tok | " + " | ".join(sides[0].latency) + " |"]  # fmt: skip
    lines.append("|" + "---|" * (3 + len(groups) + len(sides[0].latency)))
    for s in sides:
        total = sum(s.per_1k(g) for g in s.cpu_ms if g != "gone")
        cells = [s.label, str(s.tokens), *(f"{s.per_1k(g):.0f}" for g in groups), f"{total:.0f}",
                 *(f"{v:.1f}" for v in s.latency.values())]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    own_groups = [g for g in groups if g != "ray"]
    lines += ["", "| side | instances | idle % of a core: " + " / ".join(groups)
              + " | idle, own threads: " + " / ".join(own_groups) + " | all own"
              + " | pulls/s idle | pulls/s load | tokens/s | tokens/pull | front µs/pull"
              " | front ms/request | PSS MB/instance | streams lost |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in sides:
        idle = " / ".join(f"{s.idle_pct.get(g, 0.0):.1f}" for g in groups)
        own = [s.idle_own_pct.get(g, 0.0) for g in own_groups]
        idle += " | " + " / ".join(f"{v:.1f}" for v in own) + f" | {sum(own):.1f}"
        pulls = [f"{v:.0f}" if v is not None else "n/a" for v in s.pulls_per_s.values()]
        load_pulls, per_pull = s.pulls_per_s.get("load"), s.front_us_per_pull()
        per_token = f"{s.tokens_per_s / load_pulls:.1f}" if load_pulls else "n/a"
        pss = statistics.mean(s.instance_pss_mb) if s.instance_pss_mb else 0.0
        lines.append(f"| {s.label} | {s.num_instances} | {idle} | {' | '.join(pulls)} | "
                     f"{s.tokens_per_s:.0f} | {per_token} | "
                     f"{'n/a' if per_pull is None else f'{per_pull:.0f}'} | "
                     f"{s.per_request('front'):.1f} | {pss:.0f} | {s.num_lost} |")  # fmt: skip
    lines += ["", scaling_report(sides)]
    if any(s.checks for s in sides):
        lines += ["", scale_report(sides)]
    if len(sides) == 2:
        old, new = sides
        ratio = new.per_1k("front") / max(old.per_1k("front"), 1e-9)
        total_old = sum(old.per_1k(g) for g in old.cpu_ms if g != "gone")
        total_new = sum(new.per_1k(g) for g in new.cpu_ms if g != "gone")
        lines.append(f"\nfront {new.label} ÷ {old.label}: {ratio:.2f}; all processes: "
                     f"{total_new / max(total_old, 1e-9):.2f}")  # fmt: skip
    return "\n".join(lines)


def scaling_report(sides: list[Side]) -> str:
    """The load's streamed tokens/s (and ÷ the first side's), the front's CPU per 1k tokens
    and its cores busy, and the load's latencies."""
    base = sides[0].tokens_per_s or 1e-9
    lines = ["| side | tokens/s | ÷ first | front ms/1k tok | front cores | TTFT p50, p99 ms"
             " | event gap p50, p99 ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in sides:
        lat = s.load_latency
        cores = s.cpu_ms.get("front", 0.0) / 1000 / max(s.load_s, 1e-9)
        lines.append(f"| {s.label} | {s.tokens_per_s:.0f} | {s.tokens_per_s / base:.2f} | "
                     f"{s.per_1k('front'):.0f} | {cores:.2f} | "
                     f"{lat.get('ttft_p50', 0):.0f}, {lat.get('ttft_p99', 0):.0f} | "
                     f"{lat.get('gap_p50', 0):.1f}, {lat.get('gap_p99', 0):.1f} |")  # fmt: skip
    return "\n".join(lines)


def scale_report(sides: list[Side]) -> str:
    """The --trace checks: completeness, leaks, modeled throughput, startup and memory."""
    lines = ["| side | instances | up in s | complete / requests | errors | peak streams | "
             "tokens/s wall | tokens/s modeled | overrun steps | all blocks free | "
             "planner round ms | PSS MB/instance mean, max | front PSS MB |",
             "|---" * 13 + "|"]  # fmt: skip
    for s in sides:
        c = s.checks
        if not c:
            continue
        overrun = c["sim_overrun_share"]
        modeled = c["tokens_per_s_modeled"]
        planner = c["planner_round_s"]
        free = "yes" if c["all_blocks_free"] else f"**no**: {', '.join(c['instances_holding'])}"
        pss = s.instance_pss_mb or [0.0]
        cells = [
            s.label, str(s.num_instances), f"{s.ready_s:.0f}",
            f"{c['num_complete']} / {c['num_requests']}", str(c["num_errors"]),
            str(c["peak_streams"]), f"{c['tokens_per_s_wall']:.0f}",
            f"{modeled:.0f} (×{c['sim_time_scale']:g})" if modeled else "n/a",
            f"{overrun:.2%} of {c['sim_steps']}" if overrun is not None else "n/a",
            free, f"{planner * 1000:.0f}" if planner is not None else "n/a",
            f"{statistics.mean(pss):.0f}, {max(pss):.0f}", f"{sum(s.front_pss_mb):.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="ray_configs/local-1p1d.yaml")
    parser.add_argument("--checkout", type=Path, default=None,
                        help="measure this checkout too, first (e.g. the commit before)")  # fmt: skip
    parser.add_argument("--label", action="append", default=None,
                        help="side names, in order (default: other, this)")  # fmt: skip
    parser.add_argument("--serve-args", default="",
                        help="more `pdcluster serve` flags for every side, e.g. "
                        "'--sim-time-scale 1'")  # fmt: skip
    parser.add_argument("--variant", action="append", default=None, metavar="LABEL=FLAGS",
                        help="a side of this checkout with these serve flags, e.g. "
                        "'interval-8=--stream-interval 8' (repeatable)")  # fmt: skip
    parser.add_argument("--replicas", type=lambda v: [int(n) for n in v.split(",")],
                        default=None, metavar="N,N,...",
                        help="one side per gateway replica count (--api-server-count), e.g. "
                        "1,2,4: does the front scale with its replicas?")  # fmt: skip
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
    t = parser.add_argument_group("a load drawn from a trace, checked as a scale run must be")
    t.add_argument("--trace", nargs="?", const=str(default_trace()), default=None,
                   help="the load's prompt and output lengths from this trace CSV (no value: "
                   "%(const)s)")  # fmt: skip
    lengths = LengthScaling()
    t.add_argument("--window-start-s", type=float, default=0.0, help="trace window start")
    t.add_argument("--token-scale", type=float, default=lengths.token_scale,
                   help="× the trace's prompt and output lengths")  # fmt: skip
    t.add_argument("--max-prompt-len", type=int, default=lengths.max_prompt_len)
    t.add_argument("--max-output-len", type=int, default=lengths.max_output_len)
    t.add_argument("--seed", type=int, default=0, help="of the prompts' random token ids")
    t.add_argument("--settle-timeout-s", type=float, default=120.0,
                   help="how long every instance may take to hold nothing after the load")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write every side here")
    args = parser.parse_args(argv)
    serve_args = tuple(shlex.split(args.serve_args))
    variants = [(f"replicas-{n}", f"--api-server-count {n}") for n in args.replicas or ()]
    variants += [tuple(v.split("=", 1)) for v in args.variant or ()]
    if variants:  # this checkout, once per variant
        sides = [measure(REPO_ROOT, label, args, (*serve_args, *shlex.split(flags)))
                 for label, flags in variants]  # fmt: skip
    else:
        checkouts = ([args.checkout] if args.checkout else []) + [REPO_ROOT]
        labels = args.label or ["other", "this"][-len(checkouts) :]
        sides = [measure(c.resolve(), label, args, serve_args)
                 for c, label in zip(checkouts, labels)]  # fmt: skip
    print(report(sides))
    if args.json:
        sides_data = [dataclasses.asdict(s) for s in sides]
        args.json.write_text(json.dumps({"argv": argv or sys.argv[1:], "sides": sides_data}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
