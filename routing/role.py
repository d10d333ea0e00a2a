"""An instance's role, defined once for every layer above the engine. A `str` enum: YAML,
JSON and HTTP bodies carry the plain names ("prefill"), which compare and hash equal to
the members, and a member formats as its name."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    ENCODER = "encoder"  # E: the vision encoder only; hands encoder outputs to P
    PREFILL = "prefill"  # P: the prompt and first token; hands KV blocks to D
    DECODE = "decode"  # D: the remaining tokens, from P's KV
    MIXED = "mixed"  # everything, colocated

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str) -> Role:
        """`value` as a Role; ValueError naming the roles otherwise."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(r.value for r in cls)
            raise ValueError(f"role must be one of {names}, got {value!r}") from None
