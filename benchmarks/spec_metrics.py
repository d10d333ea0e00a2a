"""Speculative decoding's counters read from a server's `/metrics` (vLLM's names, so a vLLM
server's too), and what one run added to them: drafts, draft tokens, accepted tokens, the
acceptance rate and the accepted tokens per draft by position."""

from __future__ import annotations

import re
from typing import Any

import httpx

PREFIX = "vllm:spec_decode_"
_POSITION = re.compile(r'position="(\d+)"')


def parse_spec_counters(text: str) -> dict[str, float]:
    """Each spec-decode counter of a Prometheus text page summed over its label sets (every
    instance, model); the per-position one by position, as `per_pos:N`."""
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0].removeprefix(PREFIX).removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            match = _POSITION.search(series)
            if match is None:
                continue
            name = f"per_pos:{match.group(1)}"
        counters[name] = counters.get(name, 0.0) + float(value)
    return counters


def read_spec_counters(url: str, api_key: str | None = None) -> dict[str, float] | None:
    """The server's spec-decode counters; None when its /metrics cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=10.0)
        reply.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_spec_counters(reply.text)


def spec_decode_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any] | None:
    """What a run added to the counters; None where nothing was drafted (a server that does
    not speculate, or whose /metrics cannot be read)."""
    if before is None or after is None:
        return None
    added = {k: after[k] - before.get(k, 0.0) for k in after}
    num_drafts = int(added.get("num_drafts", 0))
    if not num_drafts:
        return None
    draft_tokens = int(added.get("num_draft_tokens", 0))
    accepted = int(added.get("num_accepted_tokens", 0))
    positions = sorted(int(k.split(":")[1]) for k in added if k.startswith("per_pos:"))
    per_pos = [added[f"per_pos:{p}"] for p in positions]
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "accepted_per_draft_by_position": [round(n / num_drafts, 3) for n in per_pos],
    }
