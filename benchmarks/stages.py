"""Where a request's time goes: its per-stage durations, from the stage times the instances
stamp and the gateway replica collects (`Front.traces()`), joined to the client's results.

Stages (ms) of one request, P being the instance that ran its prefill (a mixed one in a
colocated topology) and D the decode instance of a disaggregated one:

- `to_instance`: the replica planned it → P's `submit` ran
- `queue`: → the start of P's first step that ran it (waiting for a step, budget or KV)
- `prefill`: → the end of P's step that produced the first token (all prefill chunks)
- `to_replica`: → the first token reached the replica (the pull)
- `gateway_http`: the client's TTFT minus the replica's (HTTP, tokenization, SSE)
- `to_decode`: P's first token → D's `submit` ran (P tells D)
- `kv_wait`: → the start of D's first step that ran it (KV load, D's step in flight)
- `first_decode_step`: → the end of that step (D's second token)
- `decode`: P's first token → the last token left its instance (handoff included)
- `decode_per_token`: `decode` ÷ (output tokens − 1), the server's TPOT
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcluster.actors.front import TRACE_PROMPT_HEAD
from pdcluster.actors.messages import RequestTrace, StageTimes
from pdcluster.benchmarks.client import PreparedRequest, RequestResult
from pdcluster.benchmarks.metrics import percentile

STAGES = (
    "to_instance",
    "queue",
    "prefill",
    "to_replica",
    "gateway_http",
    "to_decode",
    "kv_wait",
    "first_decode_step",
    "decode",
    "decode_per_token",
)


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round((end - start) * 1e3, 3)


def request_stages(trace: RequestTrace, client_ttft_s: float | None) -> dict[str, float | None]:
    """The stage durations (ms) of one traced request; None where it did not pass a stage."""
    prefill = next((s for s in trace.stage_times if s.role != "decode"), None)
    decode: StageTimes | None = next((s for s in trace.stage_times if s.role == "decode"), None)
    if prefill is None:
        return {}
    last = decode or prefill
    out = {
        "to_instance": _ms(trace.started_s, prefill.received_s),
        "queue": _ms(prefill.received_s, prefill.scheduled_s),
        "prefill": _ms(prefill.scheduled_s, prefill.first_token_s),
        "to_replica": _ms(prefill.first_token_s, trace.first_token_s),
        "gateway_http": None,
        "to_decode": _ms(prefill.first_token_s, decode.received_s) if decode else None,
        "kv_wait": _ms(decode.received_s, decode.scheduled_s) if decode else None,
        "first_decode_step": _ms(decode.scheduled_s, decode.first_token_s) if decode else None,
        "decode": _ms(prefill.first_token_s, last.finished_s),
        "decode_per_token": None,
    }
    replica_ttft = _ms(trace.started_s, trace.first_token_s)
    if client_ttft_s is not None and replica_ttft is not None:
        out["gateway_http"] = round(client_ttft_s * 1e3 - replica_ttft, 3)
    if out["decode"] is not None and trace.num_output_tokens > 1:
        out["decode_per_token"] = round(out["decode"] / (trace.num_output_tokens - 1), 3)
    return out


def _prompt_head(prompt: Any) -> tuple[int, ...] | None:
    """The head a trace keeps of a token-id prompt; None for any other prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return tuple(prompt[:TRACE_PROMPT_HEAD])
    return None


def join(
    prepared: Sequence[PreparedRequest],
    results: Sequence[RequestResult],
    traces: Sequence[RequestTrace],
) -> list[dict[str, float | None] | None]:
    """Each result's stage durations, found by its prompt's first token ids (token-id
    prompts only: chat requests are not matched); None where no trace matches."""
    by_head: dict[tuple[int, ...], RequestTrace] = {}
    for trace in traces:
        by_head[trace.prompt_head] = trace  # the latest wins: prompts are fresh per run
    out: list[dict[str, float | None] | None] = []
    for request, result in zip(prepared, results):
        head = _prompt_head(request.body.get("prompt"))
        trace = None if head is None else by_head.get(head)
        out.append(None if trace is None else request_stages(trace, result.ttft_s))
    return out


def summarize_stages(stages: Sequence[dict[str, float | None] | None]) -> dict[str, Any]:
    """p50 / p90 / mean (ms) of each stage over the requests that passed it."""
    out: dict[str, Any] = {"num_traced": sum(1 for s in stages if s)}
    for name in STAGES:
        values = [v for s in stages if s and (v := s.get(name)) is not None]
        if values:
            out[name] = {
                "p50": round(percentile(values, 50), 3),
                "p90": round(percentile(values, 90), 3),
                "mean": round(sum(values) / len(values), 3),
            }
    return out
