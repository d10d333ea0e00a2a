"""`pdcluster serve`'s flags: each sets one key of the topology config (nested like the YAML),
so that every default stays defined once, in the config."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdcluster.routing.role import Role

if TYPE_CHECKING:
    from pdcluster.cluster.config import ClusterConfig


def _json_object(text: str) -> dict[str, Any]:
    """A dict-valued flag's value: a JSON object, as vLLM's flags take it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item: name=path, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        item = _json_object(text)
        if not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            raise argparse.ArgumentTypeError(f"a LoRA module needs a name and a path: {text!r}")
        return item["name"], item["path"]
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"a LoRA module is name=path, got {text!r}")
    return name, path


class _Items:
    """A flag taking one or more items (each parsed by `item`), set in the config as
    `collect(items)`."""

    def __init__(self, item: Callable[[str], Any], collect: Callable[[list[Any]], Any]) -> None:
        self.item, self.collect = item, collect


# serve flag -> the role whose instance count it sets
_ROLE_FLAGS = {
    "encoders": Role.ENCODER,
    "prefills": Role.PREFILL,
    "decodes": Role.DECODE,
    "mixed": Role.MIXED,
}
# serve flag -> (location in the config mapping, argparse type); unset flags keep the
# YAML's (or the model's default) value, so every default stays defined once, in the config.
_SERVE_OVERRIDES: dict[str, tuple[tuple[str, ...], Callable[[str], Any] | _Items]] = {
    "model": (("model",), str),
    **{flag: ((role.value, "count"), int) for flag, role in _ROLE_FLAGS.items()},
    "host": (("gateway", "host"), str),
    "port": (("gateway", "port"), int),
    "api_key": (("gateway", "api_key"), str),
    "served_model_name": (("gateway", "served_model_name"), str),
    "api_server_count": (("gateway", "replicas"), int),  # vLLM's name for it
    "stream_interval": (("gateway", "stream_interval"), int),
    "chat_template": (("gateway", "chat_template"), str),
    "chat_template_content_format": (("gateway", "chat_template_content_format"), str),
    "enable_auto_tool_choice": (("gateway", "enable_auto_tool_choice"), bool),
    "tool_call_parser": (("gateway", "tool_call_parser"), str),
    "address": (("ray", "address"), str),
    "num_blocks": (("engine", "num_blocks"), int),
    "kv_cache_memory_fraction": (("engine", "kv_cache_memory_fraction"), float),
    "block_size": (("engine", "block_size"), int),
    "max_model_len": (("engine", "max_model_len"), int),
    "max_num_seqs": (("engine", "max_num_seqs"), int),
    "scheduling_policy": (("engine", "scheduling_policy"), str),
    "device": (("engine", "device"), str),
    "dtype": (("engine", "dtype"), str),
    "quantization": (("engine", "quantization"), str),
    "sim_time_scale": (("engine", "sim_time_scale"), float),
    "tensor_parallel_size": (("engine", "tensor_parallel_size"), int),
    "num_threads": (("engine", "num_threads"), int),
    "speculative_config": (("engine", "speculative_config"), _json_object),
    "enable_lora": (("engine", "enable_lora"), bool),
    "lora_modules": (("engine", "lora_modules"), _Items(_lora_module, dict)),
    "max_loras": (("engine", "max_loras"), int),
    "max_lora_rank": (("engine", "max_lora_rank"), int),
    "max_cpu_loras": (("engine", "max_cpu_loras"), int),
    "migration_limit": (("router", "migration_limit"), int),
    "kv_pool_size": (("connector", "kv_pool_size_gib"), float),
}

SERVE_EXAMPLES = """examples:
  pdcluster serve --model preset:tiny-llama --prefills 1 --decodes 1
  pdcluster serve --model /models/Llama-3.2-1B-Instruct --prefills 2 --decodes 1 --port 8080
  pdcluster serve --config local-1e1p1d          # a built-in topology, by name
  pdcluster serve --config my-topology.yaml --num-blocks 2048
  pdcluster serve --config my-topology.yaml --kv-cache-memory-fraction 0.9   # KV by memory
  pdcluster serve --model smollm2-135m --tensor-parallel-size 2   # each instance on 2 ranks
  pdcluster serve --model smollm2-135m \\
      --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
  pdcluster serve --model /models/Llama-3.2-1B-Instruct --enable-lora --max-loras 4 \\
      --lora-modules sql=/adapters/sql chat=/adapters/chat   # requests name an adapter as model
  pdcluster serve --address 10.0.0.5:6379 --model /models/m --mixed 2   # an existing Ray
  pdcluster serve --model /models/Qwen2.5-0.5B-Instruct --enable-auto-tool-choice \\
      --tool-call-parser hermes                   # tool_choice "auto" read as Hermes calls

Without --config the topology is exactly the role counts given (none: 1 prefill, 1 decode).
Flags override the YAML; a role's own `engine:` overrides in the YAML still apply.
On a Ray cluster with token authentication, set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH,
or keep the token in ~/.ray/auth_token)."""


def _describe(path: tuple[str, ...]) -> str:
    """The config field's own description, for the flag's help."""
    from pdcluster.cluster.config import ClusterConfig

    if path[-1] == "count":
        return f"{path[0]} instances"
    model: type = ClusterConfig
    for key in path[:-1]:
        model = model.model_fields[key].annotation
    return f"{model.model_fields[path[-1]].description} (config: {'.'.join(path)})"


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config mapping the serve flags set (nested like the YAML)."""
    overrides: dict[str, Any] = {}
    for flag, (path, kind) in _SERVE_OVERRIDES.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if isinstance(kind, _Items):
            value = kind.collect(value)
        node = overrides
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    if args.config is None:  # the topology is exactly the counts given
        counts = {role: getattr(args, flag) or 0 for flag, role in _ROLE_FLAGS.items()}
        if all(getattr(args, flag) is None for flag in _ROLE_FLAGS):
            counts.update({Role.PREFILL: 1, Role.DECODE: 1})
        for role, count in counts.items():
            overrides.setdefault(role.value, {})["count"] = count
    return overrides


def load_serve_config(args: argparse.Namespace) -> ClusterConfig:
    from pdcluster.cluster.config import ClusterConfig

    return ClusterConfig.load(args.config, serve_overrides(args))


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `serve` subcommand and its flags."""
    from pdcluster.cluster.config_yaml import builtin_config_names

    p = sub.add_parser(
        "serve",
        help="start a cluster and its OpenAI-compatible gateway",
        description="Start the instances of a topology on Ray (embedded, or --address) and "
        "serve the OpenAI API until Ctrl-C or SIGTERM; then stop everything.",
        epilog=SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        default=None,
        help="topology YAML file, or a built-in topology: " + ", ".join(builtin_config_names()),
    )
    for flag, (path, kind) in _SERVE_OVERRIDES.items():
        name, help_text = f"--{flag.replace('_', '-')}", _describe(path)
        if kind is bool:  # a switch: given sets it true, absent keeps the config's
            p.add_argument(name, action="store_const", const=True, default=None, help=help_text)
        elif isinstance(kind, _Items):
            p.add_argument(name, type=kind.item, nargs="+", default=None, help=help_text)
        else:
            p.add_argument(name, type=kind, default=None, help=help_text)
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the startup progress lines and logs (default: INFO)",
    )
    return p
