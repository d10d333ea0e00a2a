"""`pdcluster` command line: serve, status, job, bench, plan, generate, make-model, profile."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from collections.abc import Callable

from pdcluster.cluster.serve_flags import add_serve_parser, load_serve_config
from pdcluster.routing.role import Role


def _cmd_make_model(args: argparse.Namespace) -> int:
    from pdcluster.engine.presets import make_model

    path = make_model(args.preset, args.out)
    print(path)
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from pdcluster.engine.sim.fit import grid, profile_model
    from pdcluster.engine.sim.profile import write_profile

    shapes = grid(
        args.prefill_tokens, args.prefill_contexts, args.decode_seqs, args.decode_contexts
    )
    name = args.name or f"{args.model.removeprefix('preset:')}-{platform.node() or 'host'}"
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # as many as an instance gets (Ray: its num_cpus)
    try:
        profile = profile_model(
            args.model,
            name,
            shapes,
            args.repeats,
            description=f"fitted by `pdcluster profile` on {platform.processor() or 'this host'} "
            f"({os.cpu_count()} CPUs, {args.threads} torch threads, "
            f"load average {os.getloadavg()[0]:.1f} at start)",
            eos_probability=args.eos_probability,
            link_bandwidth_bytes_per_s=args.link_bandwidth_gbs * 1e9,
            link_latency_s=args.link_latency_ms / 1e3,
        )
    finally:
        torch.set_num_threads(threads)
    write_profile(profile, args.out)
    fit = profile.fit
    print(
        f"{len(fit.points)} points: relative error max {fit.max_rel_error:.1%}, "
        f"mean {fit.mean_rel_error:.1%}; wrote {args.out} (use --model sim:{args.out})"
    )
    return 0


def _add_profile_parser(sub: argparse._SubParsersAction) -> None:
    from pdcluster.cluster.config import RoleSpec
    from pdcluster.engine.sim import fit

    p = sub.add_parser(
        "profile",
        help="measure a real engine's step times here and fit a sim profile",
        description="Step the real model over a grid of prefill and decode shapes, fit the "
        "simulator's step-time model by least squares and write it as a profile JSON "
        "(serve it with --model sim:FILE.json).",
    )
    p.add_argument("--model", required=True, help="model to measure (e.g. smollm2-135m)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--name", default=None, help="profile name (default: model-host)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per shape (median)")
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, int(RoleSpec.model_fields["num_cpus"].default)),
        help="torch threads while measuring: match the instances' num_cpus, since Ray runs "
        "each instance with that many threads (default: the role default)",
    )
    ints = {"type": int, "nargs": "+"}
    p.add_argument("--prefill-tokens", default=fit.PREFILL_TOKENS, **ints)
    p.add_argument("--prefill-contexts", default=fit.PREFILL_CONTEXTS, **ints)
    p.add_argument("--decode-seqs", default=fit.DECODE_SEQS, **ints)
    p.add_argument("--decode-contexts", default=fit.DECODE_CONTEXTS, **ints)
    p.add_argument("--eos-probability", type=float, default=0.0, help="per generated token")
    p.add_argument("--link-bandwidth-gbs", type=float, default=2.0, help="P->D GB/s (modeled)")
    p.add_argument("--link-latency-ms", type=float, default=2.0, help="per P->D transfer")
    p.set_defaults(func=_cmd_profile)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    for out in llm.generate(args.prompt, params):
        print(json.dumps({"text": out.text, "finish_reason": out.finish_reason}))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pdcluster.cluster.serve import serve

    serve(load_serve_config(args))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.get(f"{args.url.rstrip('/')}/v1/cluster", headers=headers, timeout=10)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot read {args.url}/v1/cluster: {exc}") from None
    columns = ["id", "role", "healthy", "num_blocks_free", "num_blocks_total", "num_running",
               "num_waiting", "num_deferred", "num_pending_transfers"]  # fmt: skip
    rows = [[str(i.get(c, "")) for c in columns] for i in response.json()["instances"]]
    widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(columns)]
    for row in [columns, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    """Resize a role through a running gateway (`--url`) or the pool's controller on a Ray
    cluster (`--address`)."""
    role = Role(args.role)
    if args.address:
        ids = _scale_on_ray(args.address, args.pool, args.namespace, role, args.count)
    else:
        ids = _scale_over_http(args.url, args.api_key, role, args.count)
    print(f"{role}: {len(ids)} instances" + "".join(f"\n  {i}" for i in ids))
    return 0


def _scale_over_http(url: str, api_key: str | None, role: Role, count: int) -> list[str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = f"{url.rstrip('/')}/v1/admin/scale"
    try:  # adding waits for the new instances to load (and maybe for a node)
        response = httpx.post(
            endpoint, json={"role": role.value, "count": count}, headers=headers, timeout=900
        )
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {endpoint}: {exc}") from None
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ValueError(f"{endpoint}: {response.status_code}: {message}")
    return response.json()["instances"]


def _scale_on_ray(
    address: str, pool: str | None, namespace: str, role: Role, count: int
) -> list[str]:
    import asyncio

    from pdcluster.actors.pool_client import PoolClient, actor_names
    from pdcluster.cluster.config import RaySettings
    from pdcluster.cluster.control.launch import init_ray
    from pdcluster.cluster.control.pool import controller_name

    init_ray(RaySettings(address=address, namespace=namespace))
    suffix = controller_name("")
    controllers = [n for n in actor_names(namespace) if n.endswith(suffix)]
    if pool is None and len(controllers) != 1:
        raise ValueError(f"name the pool with --pool; controllers found: {controllers or 'none'}")
    pool = pool or controllers[0].removesuffix(suffix)
    client = PoolClient.find(pool, controller_name(pool), namespace)
    if client is None:
        name = controller_name(pool)
        raise ValueError(f"no pool controller {name!r} in namespace {namespace!r}")
    try:
        members = asyncio.run(client.scale(role, count))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - no room (PlacementTimeout), or the controller's
        raise ValueError(str(getattr(exc, "cause", None) or exc)) from None
    return sorted(i for i, r in members.items() if r == role)


def build_parser() -> argparse.ArgumentParser:
    from pdcluster import __version__

    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdcluster {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a built-in random-weight checkpoint")
    p.add_argument(
        "--preset",
        default="tiny-llama",
        help="tiny-llama, tiny-qwen2, tiny-llava, small-llama, small-llava",
    )
    p.add_argument("--out", required=True, help="folder to write")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("generate", help="generate offline in this process (no Ray)")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--model", default=None, help="checkpoint folder (default: built-in preset)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_cmd_generate)

    add_serve_parser(sub).set_defaults(func=_cmd_serve)

    p = sub.add_parser("status", help="the instances of a running gateway, as a table")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--api-key", default=None)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "scale",
        help="add or drain instances of a role at run time",
        epilog="examples:\n  pdcluster scale --role decode --count 3\n"
        "  pdcluster scale --address 10.0.0.5:6379 --pool pdcluster-serve --role prefill "
        "--count 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--role", required=True, choices=[r.value for r in Role])
    p.add_argument("--count", required=True, type=int, help="instances of the role wanted")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running gateway")
    p.add_argument("--api-key", default=None)
    p.add_argument("--address", default=None, help="a Ray cluster instead of --url")
    p.add_argument("--pool", default=None, help="with --address: the pool (if several)")
    p.add_argument("--namespace", default="pdcluster", help="with --address: Ray namespace")
    p.set_defaults(func=_cmd_scale)

    _add_profile_parser(sub)

    # `pdcluster job ...` is handed to cluster.job's own parser in main().
    sub.add_parser("job", help="batch inference: JSONL in, JSONL out (pdcluster job --help)")
    # `pdcluster bench ...` is handed to benchmarks.bench's own parser in main().
    sub.add_parser("bench", help="serving benchmark: latency, SLO attainment, goodput")
    # `pdcluster plan ...` is handed to benchmarks.plan's own parser in main().
    sub.add_parser("plan", help="the P:D split of N instances with the best goodput (simulated)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:  # the job has its own parser (and --help)
        from pdcluster.cluster.job import main as job_main

        return job_main(argv[1:])
    if argv[:1] == ["bench"] and "--elastic" in argv:  # elastic vs fixed pools (its own parser)
        from pdcluster.benchmarks.elastic import main as elastic_main

        return elastic_main([a for a in argv[1:] if a != "--elastic"])
    if argv[:1] == ["bench"] and "--handoff-ttft" in argv:  # P->D TTFT vs the prefill alone
        from pdcluster.benchmarks.handoff_ttft import main as handoff_main

        return handoff_main([a for a in argv[1:] if a != "--handoff-ttft"])
    if argv[:1] == ["bench"] and "--sessions" in argv:  # KV pool off vs on (its own parser)
        from pdcluster.benchmarks.sessions import main as sessions_main

        return sessions_main([a for a in argv[1:] if a != "--sessions"])
    if argv[:1] == ["bench"]:  # the benchmark has its own parser (and --help)
        from pdcluster.benchmarks.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["plan"]:  # the planner has its own parser (and --help)
        from pdcluster.benchmarks.plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError, ConnectionError, TimeoutError) as exc:
        # bad input, a Ray cluster that cannot be reached, a topology that does not fit it,
        # or instances that found no room in time: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
