"""What an instance computes in: the `dtype` and `quantization` settings resolved for a device.

On a GPU the whole model runs in `dtype` ("auto": bfloat16). On a CPU activations, norms,
attention and the KV cache stay float32 whatever the setting, and `dtype` picks the weights of
the linear layers: bf16 activations and elementwise ops are slower there than float32 ones,
and only the linears' weights gain from bf16. float16 on a CPU is served as bfloat16 (oneDNN
packs float16 weights only on CPUs with AVX512-FP16), as vLLM's CPU backend does.

"auto" on a CPU is float32 without a quantization: the exact mode, which matches transformers
token for token. With one (already inexact) the linears' float formats are raced at load:
bfloat16 and float32 where oneDNN multiplies bf16 natively, float32 elsewhere
(engine/models/tiered_linear.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdcluster.engine.config import Quantization
from pdcluster.engine.models.packed_linear import native_bf16

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype  # activations, attention, the KV cache, and weights as loaded
    # The float formats a CPU runner's linear layers may take (raced at load when several);
    # on a GPU just `dtype`.
    linear_dtypes: tuple[torch.dtype, ...]
    quantization: Quantization

    @classmethod
    def resolve(cls, dtype: str, quantization: Quantization, device: torch.device) -> Precision:
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {tuple(DTYPES)}, got {dtype!r}")
        if device.type != "cpu":
            resolved = torch.bfloat16 if dtype == "auto" else DTYPES[dtype]
            return cls(resolved, (resolved,), quantization)
        if dtype == "float16":
            logger.warning("float16 on CPU: linear weights in bfloat16 instead")
        if dtype in ("bfloat16", "float16"):
            return cls(torch.float32, (torch.bfloat16,), quantization)
        if dtype == "float32" or quantization == "none" or not native_bf16():
            return cls(torch.float32, (torch.float32,), quantization)
        return cls(torch.float32, (torch.bfloat16, torch.float32), quantization)

    @property
    def is_exact(self) -> bool:
        """float32 throughout: the checkpoint's layers, results as transformers'."""
        return self.quantization == "none" and self.linear_dtypes == (torch.float32,)
