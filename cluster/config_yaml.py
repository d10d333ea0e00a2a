"""Topology YAML files: the built-in topologies, reading one, merging overrides on top, and
the strict model every config section is (an unknown key, e.g. a typo, fails validation)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

# The built-in topologies: ray_configs/ in a checkout, package data once installed
# (pdcluster/configs links to ray_configs/). The `ray up` config there is no topology.
BUILTIN_CONFIG_DIR = Path(str(files("pdcluster") / "configs")).resolve()
_NOT_TOPOLOGIES = {"cluster-launcher"}


def builtin_config_names() -> list[str]:
    """Names `--config` accepts besides paths, e.g. 'local-1p1d'."""
    stems = (p.stem for p in BUILTIN_CONFIG_DIR.glob("*.yaml"))
    return sorted(s for s in stems if s not in _NOT_TOPOLOGIES)


def config_path(name_or_path: str | Path) -> Path:
    """The YAML file of `name_or_path`: an existing file, else a built-in topology's name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    names = builtin_config_names()
    if str(name_or_path) in names:
        return BUILTIN_CONFIG_DIR / f"{name_or_path}.yaml"
    raise FileNotFoundError(
        f"no config file {str(name_or_path)!r} and no built-in topology of that name "
        f"(built-in: {', '.join(names)})"
    )


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping; syntax errors name the file, line and column in one message."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"{where}: invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cluster config is a YAML mapping")
    return data


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` applied key by key, nested mappings merged recursively."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def describe_errors(exc: ValidationError) -> str:
    """A pydantic error list as one line: `field.path: message (got value)`; ..."""
    parts = []
    for e in exc.errors():
        message = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:  # a cross-field rule of the whole config
            parts.append(message)
            continue
        got = "" if isinstance(e["input"], dict) else f" (got {e['input']!r})"
        parts.append(f"{'.'.join(map(str, e['loc']))}: {message}{got}")
    return "; ".join(parts)


class StrictSection(BaseModel):
    """A config section: unknown keys fail, and values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
