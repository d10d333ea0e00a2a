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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
