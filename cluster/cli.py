"""`pdcluster` command line: make-model, generate (more subcommands register below)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def _cmd_make_model(args: argparse.Namespace) -> int:
    from engine.presets import make_model

    path = make_model(args.preset, args.out)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    for out in llm.generate(args.prompt, params):
        print(json.dumps({"text": out.text, "finish_reason": out.finish_reason}))
    return 0


def _load_config(args: argparse.Namespace):
    from cluster.config import ClusterConfig

    config = ClusterConfig.from_yaml(args.config)
    gateway, ray_settings = config.gateway, config.ray
    if getattr(args, "host", None):
        gateway = gateway.model_copy(update={"host": args.host})
    if getattr(args, "port", None) is not None:
        gateway = gateway.model_copy(update={"port": args.port})
    if getattr(args, "address", None):
        ray_settings = ray_settings.model_copy(update={"address": args.address})
    return config.model_copy(update={"gateway": gateway, "ray": ray_settings})


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster.serve import serve

    serve(_load_config(args))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a built-in random-weight checkpoint")
    p.add_argument(
        "--preset", default="tiny-llama", help="tiny-llama, tiny-qwen2, tiny-llava, small-llama"
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

    p = sub.add_parser("serve", help="start a cluster and its OpenAI-compatible gateway")
    p.add_argument("--config", default="ray_configs/local-1e1p1d.yaml", help="topology YAML")
    p.add_argument("--host", default=None, help="listen address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default from config)")
    p.add_argument("--address", default=None, help="existing Ray cluster (default: embedded)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("status", help="the instances of a running gateway, as a table")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--api-key", default=None)
    p.set_defaults(func=_cmd_status)

    # `pdcluster job ...` is handed to cluster.job's own parser in main().
    sub.add_parser("job", help="batch inference: JSONL in, JSONL out (pdcluster job --help)")
    # `pdcluster bench ...` is handed to benchmarks.bench's own parser in main().
    sub.add_parser("bench", help="serving benchmark: latency, SLO attainment, goodput")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:  # the job has its own parser (and --help)
        from cluster.job import main as job_main

        return job_main(argv[1:])
    if argv[:1] == ["bench"]:  # the benchmark has its own parser (and --help)
        from benchmarks.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
