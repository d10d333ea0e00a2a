"""Multi-turn sessions with the cluster KV pool off and on, in one run (`pdcluster bench
--sessions`).

A session is `--turns` turns: each adds a user message (`--user-tokens` lo,hi random token
ids) to a history that starts with a `--system-tokens` system prompt and holds every earlier
message and reply (`--reply-tokens`, greedy, `ignore_eos`). Sessions start at `--session-rate`
per second (Poisson), and each sends its next turn `--think-s` after its reply ended, so many
sessions are live at once: more history than the instances' own KV caches (`--num-blocks`
each) hold. The same sessions (same seed) run on one topology launched twice, the pool off
(`connector.kv_pool_size_gib: 0`) and on (the default size), each in the same embedded Ray.

Reported per variant: TTFT p50/p90 of first turns and of follow-up turns (client side, from
submission to the first token), and prompt tokens computed (a request's prompt minus the
tokens its first-token instance found in a cache: its own or the pool), with the ratios on ÷
off, and the load average at the start and end of each variant.

`--add-prefill-at-s T` adds one prefill instance T seconds into each variant (a scale-up
under load); the report then has the follow-ups that new P served (their TTFT, and the
tokens they computed): cold without the pool, served from it with.

    python -m pdcluster.benchmarks.sessions --model smollm2-135m --prefills 2 --decodes 1 \\
        --sessions 16 --turns 4 --out sessions-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.pool_messages import KVPoolStats
from pdcluster.benchmarks.metrics import percentile
from pdcluster.benchmarks.report import loadavg, save_results
from pdcluster.benchmarks.targets import embedded_ray, pd_config
from pdcluster.engine import SamplingParams

IDLE_TIMEOUT_S = 300.0
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary ids of SmolLM2 (no special tokens)


@dataclass
class Turn:
    session: int
    index: int
    request_id: str
    sent_s: float  # time.perf_counter()
    num_prompt_tokens: int
    ttft_s: float
    num_cached_tokens: int


@dataclass
class ScaleUp:
    """The prefill instance added mid-run, and when (seconds into the run)."""

    instance_id: str
    asked_s: float
    up_s: float


@dataclass
class Session:
    index: int
    start_s: float
    system: list[int]
    user_messages: list[list[int]]
    history: list[int] = field(default_factory=list)


def make_sessions(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    lo, hi = args.user_tokens
    sessions, start_s = [], 0.0
    for i in range(args.num_sessions):
        system = [rng.randrange(*args.token_range) for _ in range(args.system_tokens)]
        users = [
            [rng.randrange(*args.token_range) for _ in range(rng.randint(lo, hi))]
            for _ in range(args.turns)
        ]
        sessions.append(Session(i, start_s, system, users))
        start_s += rng.expovariate(args.session_rate)
    return sessions


async def run_session(cluster: Any, session: Session, args: argparse.Namespace) -> list[Turn]:
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    history = list(session.system)
    turns = []
    for index, user in enumerate(session.user_messages):
        prompt = [*history, *user]
        request = cluster.make_request({"prompt_token_ids": prompt}, params)
        sent_s = time.perf_counter()
        ttft_s, num_cached, reply = None, 0, []
        async for out in cluster.stream(request):
            if out.error:
                raise RuntimeError(f"session {session.index} turn {index}: {out.error}")
            if ttft_s is None and out.new_token_ids:
                ttft_s, num_cached = time.perf_counter() - sent_s, out.num_cached_tokens
            reply.extend(out.new_token_ids)
        turns.append(
            Turn(
                session.index,
                index,
                request.request_id,
                sent_s,
                len(prompt),
                ttft_s or 0.0,
                num_cached,
            )
        )
        history = [*prompt, *reply]
        await asyncio.sleep(args.think_s)
    return turns


async def run_all(
    cluster: Any, sessions: list[Session], args: argparse.Namespace
) -> tuple[list[Turn], ScaleUp | None]:
    started = time.perf_counter()

    async def one(session: Session) -> list[Turn]:
        await asyncio.sleep(max(0.0, session.start_s - (time.perf_counter() - started)))
        return await run_session(cluster, session, args)

    async def add_prefill() -> ScaleUp:
        await asyncio.sleep(args.add_prefill_at_s)
        before = set(cluster.instances)
        asked_s = time.perf_counter() - started
        members = await cluster.scale("prefill", args.prefills + 1)
        (added,) = (i for i, role in members.items() if role == "prefill" and i not in before)
        return ScaleUp(added, round(asked_s, 1), round(time.perf_counter() - started, 1))

    scale_up = None if args.add_prefill_at_s is None else asyncio.create_task(add_prefill())
    results = await asyncio.gather(*(one(s) for s in sessions))
    return [t for turns in results for t in turns], scale_up and await scale_up


def run_variant(args: argparse.Namespace, pool_on: bool) -> dict[str, Any]:
    from pdcluster.cluster.control.launch import launch

    engine = {
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_seqs": 64,
        "max_model_len": args.max_model_len,
    }
    config = pd_config(args, engine, connector={"kv_pool_size_gib": None if pool_on else 0})
    cluster = launch(config)
    try:
        load_start = loadavg()
        wall_s = time.perf_counter()
        turns, scale_up = asyncio.run(run_all(cluster, make_sessions(args), args))
        wall_s = time.perf_counter() - wall_s
        load_end = loadavg()
        cluster.wait_idle(IDLE_TIMEOUT_S)
        pool = asyncio.run(cluster.kv_pool_stats()) if pool_on else None
        instances = cluster.stats()
        first_token_on = first_token_instances(cluster.front.traces())
    finally:
        cluster.shutdown()
    result = summarize(turns, pool_on, wall_s, load_start, load_end, pool, instances)
    if scale_up is not None:
        result["added_prefill"] = served_by(scale_up, turns, first_token_on)
    return result


def first_token_instances(traces: list[Any]) -> dict[str, str]:
    """request id -> the instance that produced its first token (its P, or its mixed)."""
    return {
        t.request_id: s.instance_id
        for t in traces
        for s in t.stage_times[:1]  # the first instance a request passed made its first token
    }


def served_by(
    scale_up: ScaleUp, turns: list[Turn], first_token_on: dict[str, str]
) -> dict[str, Any]:
    """The follow-ups the added P served: how many, their TTFT, the tokens they computed."""
    mine = sorted(
        (
            t
            for t in turns
            if t.index > 0 and first_token_on.get(t.request_id) == scale_up.instance_id
        ),
        key=lambda t: t.sent_s,
    )
    return {
        "instance_id": scale_up.instance_id,
        "asked_at_s": scale_up.asked_s,
        "up_at_s": scale_up.up_s,
        "follow_ups": len(mine),
        "follow_up_ttft_ms": _ttft_ms(mine),
        "first_follow_ups_ttft_ms": [_ms(t.ttft_s) for t in mine[:4]],
        "follow_up_prompt_tokens": sum(t.num_prompt_tokens for t in mine),
        "follow_up_prompt_tokens_computed": _tokens_computed(mine),
    }


def summarize(
    turns: list[Turn],
    pool_on: bool,
    wall_s: float,
    load_start: list[float] | None,
    load_end: list[float] | None,
    pool: KVPoolStats | None,
    instances: list[InstanceStats],
) -> dict[str, Any]:
    first = [t for t in turns if t.index == 0]
    follow = [t for t in turns if t.index > 0]
    return {
        "variant": "pool on" if pool_on else "pool off",
        "turns": len(turns),
        "first_turn_ttft_ms": _ttft_ms(first),
        "follow_up_ttft_ms": _ttft_ms(follow),
        "follow_up_prompt_tokens": sum(t.num_prompt_tokens for t in follow),
        "follow_up_prompt_tokens_computed": _tokens_computed(follow),
        "all_prompt_tokens_computed": _tokens_computed(turns),
        "kv_pool_hit_tokens": sum(s.kv_pool.hit_tokens for s in instances),
        "kv_pool_mean_load_ms": _mean([s.kv_pool.mean_load_ms for s in instances]),
        "kv_pool": None if pool is None else pool.to_dict(),
        "wall_s": round(wall_s, 1),
        "load_avg_start": load_start,
        "load_avg_end": load_end,
    }


def _ttft_ms(turns: list[Turn]) -> dict[str, float | None]:
    values = [t.ttft_s for t in turns]
    return {f"p{q}": _ms(percentile(values, q)) for q in (50, 90)}


def _tokens_computed(turns: list[Turn]) -> int:
    """Prompt tokens the turns' first-token instances computed (not found in a cache)."""
    return sum(t.num_prompt_tokens - t.num_cached_tokens for t in turns)


def _mean(figures: list[float | None]) -> float | None:
    values = [v for v in figures if v is not None]
    return round(sum(values) / len(values), 2) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def ratios(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "follow_up_ttft_p50_off_over_on": ratio(
            off["follow_up_ttft_ms"]["p50"], on["follow_up_ttft_ms"]["p50"]
        ),
        "follow_up_ttft_p90_off_over_on": ratio(
            off["follow_up_ttft_ms"]["p90"], on["follow_up_ttft_ms"]["p90"]
        ),
        "follow_up_tokens_computed_on_over_off": ratio(
            on["follow_up_prompt_tokens_computed"], off["follow_up_prompt_tokens_computed"]
        ),
    }


def int_pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError("want LO,HI with 0 < LO <= HI")
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster bench --sessions",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--num-sessions", type=int, default=16, help="sessions in all")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int_pair, default=(50, 200), help="LO,HI per message")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--session-rate", type=float, default=1.0, help="sessions started per second")
    p.add_argument("--think-s", type=float, default=1.0, help="pause between reply and turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per instance")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--token-range", type=int_pair, default=TOKEN_RANGE, help="LO,HI token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--add-prefill-at-s",
        type=float,
        default=None,
        help="add one prefill instance this many seconds into each variant",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for results.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    added = 0 if args.add_prefill_at_s is None else 1
    with embedded_ray(args.prefills + added + args.decodes + 1):
        off, on = (run_variant(args, pool_on) for pool_on in (False, True))
        result = {"command": argv, "off": off, "on": on, "ratios": ratios(off, on)}
    print(json.dumps(result, indent=2))
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
