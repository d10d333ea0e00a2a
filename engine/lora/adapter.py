"""A LoRA adapter as PEFT saves it (`save_pretrained`): `adapter_config.json` and
`adapter_model.safetensors`, read and checked against the base model's projections.

Each adapted projection y = W x gains (B A x) * scale, A [r, in] and B [out, r], scale =
lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`). A folder that cannot be served as
it is (a missing file, a projection pdcluster does not adapt, shapes that are not the
base model's, a rank over `max_lora_rank`, a PEFT feature this reader does not apply)
raises `LoRAAdapterError` naming what is wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
# PEFT options whose non-default values change the computation in a way not applied here
_UNSUPPORTED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "target_parameters": (None, []),
    "lora_bias": (False, None),
}


class LoRAAdapterError(ValueError):
    """An adapter folder that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs under: its name (the `model` a client asks for) and the
    folder it loads from, so that every instance, P and D alike, applies the same one."""

    name: str
    path: str


@dataclass(frozen=True)
class LoRAWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    weights: dict[str, LoRAWeights]  # module name (the model's, e.g. model.layers.0.mlp.up_proj)

    @property
    def key(self) -> LoRARequest:
        """What a request names it by: its name and folder."""
        return LoRARequest(self.name, self.path)


def read_adapter(
    lora: LoRARequest,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    rename: Callable[[str], str | None] = lambda name: name,
) -> LoRAAdapter:
    """The adapter in `lora.path`, checked against `shapes` (module name -> (in, out) of
    every projection the model adapts) and `max_rank`; LoRAAdapterError when it does not fit.
    `rename`: the checkpoint's module names to the model's (None: a module it drops)."""
    folder = Path(lora.path)
    config = _read_config(folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {lora.name!r}: no {WEIGHTS_FILE} in {folder}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                module, which = _parse_key(lora.name, key)
                pairs.setdefault(rename(module) or module, {})[which] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file: say which
        raise LoRAAdapterError(
            f"LoRA adapter {lora.name!r}: cannot read {weights_path}: {exc}"
        ) from None
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {lora.name!r}: {weights_path} holds no LoRA weights")
    weights = {
        module: _checked(lora.name, module, ab, shapes, max_rank, config, dtype)
        for module, ab in pairs.items()
    }
    return LoRAAdapter(lora.name, lora.path, weights)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAAdapterError(f"no {CONFIG_FILE} in {folder} (a PEFT LoRA adapter folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{path} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {peft_type!r} is not a LoRA adapter")
    for key, defaults in _UNSUPPORTED.items():
        if config.get(key) not in defaults:
            raise LoRAAdapterError(f"{path}: {key}={config[key]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path}: bias={config['bias']!r} is not supported (only 'none')")
    return config


def _parse_key(name: str, key: str) -> tuple[str, str]:
    """(module name, "A" or "B") of a `base_model.model.<module>.lora_A|B.weight` key."""
    match = _KEY.match(key.removeprefix(_PEFT_PREFIX))
    if match is None:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A or B matrix of a linear "
            "projection (embeddings, biases and saved modules are not supported)"
        )
    return match["module"], match["which"]


def _checked(
    name: str,
    module: str,
    ab: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    config: dict[str, Any],
    dtype: torch.dtype,
) -> LoRAWeights:
    where = f"LoRA adapter {name!r}, {module}"
    if module not in shapes:
        raise LoRAAdapterError(
            f"{where}: not a projection LoRA applies to here (the attention's q/k/v/o_proj and "
            "the dense MLP's gate/up/down_proj of each layer; MoE experts are not supported)"
        )
    if set(ab) != {"A", "B"}:
        raise LoRAAdapterError(f"{where}: needs both lora_A and lora_B weights")
    a, b = ab["A"], ab["B"]
    in_features, out_features = shapes[module]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoRAAdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank-r pair"
        )
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise LoRAAdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
            f"model's projection ({in_features} in, {out_features} out): another base model?"
        )
    rank = a.shape[0]
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    return LoRAWeights(
        a.to(dtype).contiguous(), b.to(dtype).contiguous(), _scale(module, rank, config)
    )


def _scale(module: str, rank: int, config: dict[str, Any]) -> float:
    """lora_alpha (or its alpha_pattern entry) / r, or / sqrt(r) with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
