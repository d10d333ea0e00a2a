"""Measure a real engine's step times over a grid of shapes and fit a sim profile to them.

The runner is stepped with hand-built scheduler outputs, so each measured step has exactly
the grid's shape: a prefill of `tokens` new tokens after `context` cached ones, or `seqs`
decode sequences of `context` tokens each. Every request of a shape shares one run of
blocks (their contents do not matter for timing), so the pool stays as small as one
context. The fit is a least-squares solve weighted by 1/measured (it minimises relative
error), with negative coefficients dropped and the rest refitted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdcluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.sim.profile import (
    FitReport,
    KVShape,
    SimProfile,
    StepCoefficients,
    StepShape,
    StepTimeModel,
)

PREFILL_TOKENS = (16, 64, 256, 512, 1024)
PREFILL_CONTEXTS = (0, 512)
DECODE_SEQS = (1, 4, 16, 32)
DECODE_CONTEXTS = (64, 512, 1024)
_PREFILL_TERMS = ("prefill_base_s", "prefill_per_token_s", "prefill_per_token_context_s")
_DECODE_TERMS = ("decode_base_s", "decode_per_seq_s", "decode_per_context_token_s")


@dataclass(frozen=True)
class MeasuredPoint:
    shape: StepShape
    seconds: float  # median of the repeats


def grid(
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    prefill_contexts: Sequence[int] = PREFILL_CONTEXTS,
    decode_seqs: Sequence[int] = DECODE_SEQS,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
) -> list[StepShape]:
    """Prefill shapes, decode shapes, and mixed ones (the middle prefill with each decode
    batch at the middle context: what a colocated instance steps under load)."""
    prefill = [StepShape(prefill=((n, c),)) for n in prefill_tokens for c in prefill_contexts]
    decode = [StepShape(decode_contexts=(c,) * s) for s in decode_seqs for c in decode_contexts]
    n = sorted(prefill_tokens)[len(prefill_tokens) // 2]
    c = sorted(decode_contexts)[len(decode_contexts) // 2]
    mixed = [StepShape(prefill=((n, 0),), decode_contexts=(c,) * s) for s in decode_seqs]
    return prefill + decode + mixed


def _rows(shape: StepShape) -> list[tuple[int, int]]:
    """(new tokens, context) of each request of a shape."""
    return [*shape.prefill, *((1, c) for c in shape.decode_contexts)]


def _step_output(
    shape: StepShape, block_size: int, first_id: int, tag: str, extra_tokens: int = 0
) -> SchedulerOutput:
    """New requests of `shape` (prompt = context + new tokens), ids unique per `tag`. Their
    blocks leave room for `extra_tokens` more (the decode steps that continue them)."""
    rows = _rows(shape)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    new, scheduled = [], {}
    for i, (n, context) in enumerate(rows):
        req_id = f"profile-{tag}-{i}"
        num_tokens = context + n
        blocks = list(range(-(-(num_tokens + extra_tokens) // block_size)))
        prompt = [first_id + (j * 7 + i) % 500 for j in range(num_tokens)]
        new.append(NewRequestData(req_id, prompt, [], params, blocks, context))
        scheduled[req_id] = n
    total = sum(scheduled.values())
    return SchedulerOutput(new, CachedRequestData(), scheduled, total, {}, set(), [])


def _next_decode(first: SchedulerOutput, k: int) -> SchedulerOutput:
    """The `k`-th decode step after `first`: the same requests, held by the runner, one more
    token each, as a decode instance steps them while serving."""
    req_ids = [new.req_id for new in first.scheduled_new_reqs]
    cached = CachedRequestData(
        req_ids,
        [False] * len(req_ids),
        [None] * len(req_ids),
        [new.num_computed_tokens + k for new in first.scheduled_new_reqs],
        [0] * len(req_ids),  # nothing trimmed: no drafts
    )
    return SchedulerOutput([], cached, dict.fromkeys(req_ids, 1), len(req_ids), {}, set(), [])


def _join(a: SchedulerOutput, b: SchedulerOutput) -> SchedulerOutput:
    """One step of `a`'s new requests and `b`'s (new or held) ones."""
    scheduled = a.num_scheduled_tokens | b.num_scheduled_tokens
    new = a.scheduled_new_reqs + b.scheduled_new_reqs
    cached = b.scheduled_cached_reqs
    return SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), {}, set(), [])


def measure(
    runner: object,
    shapes: Sequence[StepShape],
    block_size: int,
    first_id: int,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> list[MeasuredPoint]:
    """Median seconds of `runner.execute_model` per shape, after one warm-up step each. As
    when serving, a shape's prefill rows are new requests at every step, and its decode rows
    are requests the runner holds: the warm-up step adds them and each timed step continues
    them by a token, so per-request setup is not charged to every decode step. Those steps
    start before the shape's context and end after it, so their median is at it."""
    points, finished = [], set()
    lead = (repeats + 1) // 2
    for index, shape in enumerate(shapes):
        times = []
        decodes = StepShape(decode_contexts=tuple(max(0, c - lead) for c in shape.decode_contexts))
        held = _step_output(decodes, block_size, first_id, f"{index}-d", repeats)
        prefill = StepShape(prefill=shape.prefill)
        for attempt in range(repeats + 1):
            new = _step_output(prefill, block_size, first_id, f"{index}-{attempt}")
            so = _join(new, _next_decode(held, attempt) if attempt else held)
            so.finished_req_ids, finished = finished, set(new.num_scheduled_tokens)
            start_s = clock()
            runner.execute_model(so)
            if attempt:  # the first is a warm-up
                times.append(clock() - start_s)
        finished |= set(held.num_scheduled_tokens)
        points.append(MeasuredPoint(shape, statistics.median(times)))
    return points


def _features(shape: StepShape) -> tuple[str, list[float]]:
    if shape.prefill and shape.decode_contexts:
        return "mixed", []
    if shape.prefill:
        tokens = sum(n for n, _ in shape.prefill)
        attention = sum(n * (c + (n - 1) / 2) for n, c in shape.prefill)
        return "prefill", [1.0, float(tokens), attention]
    return "decode", [1.0, float(len(shape.decode_contexts)), float(sum(shape.decode_contexts))]


def _solve(
    rows: list[list[float]], targets: list[float], relative_to: list[float] | None = None
) -> list[float]:
    """Least squares of error relative to `relative_to` (default: the targets), dropping
    terms that come out negative."""
    x, y = np.array(rows), np.array(targets)
    weights = 1.0 / np.array(relative_to if relative_to is not None else targets)
    keep = list(range(x.shape[1]))
    while True:
        sol = np.linalg.lstsq(x[:, keep] * weights[:, None], y * weights, rcond=None)[0]
        if (sol >= 0).all() or len(keep) == 1:
            coef = np.zeros(x.shape[1])
            coef[keep] = np.maximum(sol, 0)
            return coef.tolist()
        keep.pop(int(np.argmin(sol)))


def fit(points: Sequence[MeasuredPoint]) -> tuple[StepCoefficients, FitReport]:
    """Coefficients of the step-time model, and how far they are from each point."""
    groups: dict[str, tuple[list[list[float]], list[float]]] = {
        "prefill": ([], []),
        "decode": ([], []),
    }
    mixed = []
    for p in points:
        kind, row = _features(p.shape)
        if kind == "mixed":
            mixed.append(p)
            continue
        groups[kind][0].append(row)
        groups[kind][1].append(p.seconds)
    values: dict[str, float] = {}
    for kind, terms in (("prefill", _PREFILL_TERMS), ("decode", _DECODE_TERMS)):
        rows, seconds = groups[kind]
        if rows:
            values |= dict(zip(terms, _solve(rows, seconds)))
    coefficients = StepCoefficients(**values)
    if mixed:  # the fixed cost a mixed step pays on top of its prefill and decode rows
        rows_only = StepTimeModel(coefficients.model_copy(update={"mixed_base_s": 0.0}), 0, 1, 0)
        residual = [p.seconds - rows_only.step_s(p.shape) for p in mixed]
        (base,) = _solve([[1.0]] * len(mixed), residual, [p.seconds for p in mixed])
        coefficients = coefficients.model_copy(update={"mixed_base_s": base})
    return coefficients, report(coefficients, points)


def report(coefficients: StepCoefficients, points: Sequence[MeasuredPoint]) -> FitReport:
    """Each point with its fitted time, and the max/mean relative error over them."""
    model = StepTimeModel(coefficients, 0, 1.0, 0.0)
    rows, errors = [], []
    for p in points:
        fitted = model.step_s(p.shape)
        errors.append(abs(fitted - p.seconds) / p.seconds)
        rows.append(_point_row(p, fitted))
    return FitReport(
        points=rows, max_rel_error=round(max(errors), 4), mean_rel_error=round(np.mean(errors), 4)
    )


def _point_row(p: MeasuredPoint, fitted: float) -> dict[str, float]:
    """A point as a FitReport row: a prefill's tokens and context, a decode batch's size and
    context, or both (a mixed step, its decode context as `decode_context`)."""
    row: dict[str, float] = {}
    if p.shape.prefill:
        ((n, c),) = p.shape.prefill
        row |= {"prefill_tokens": n, "context": c}
    if p.shape.decode_contexts:
        key = "decode_context" if p.shape.prefill else "context"
        row |= {"decode_seqs": len(p.shape.decode_contexts), key: p.shape.decode_contexts[0]}
    return {**row, "measured_s": round(p.seconds, 6), "fitted_s": round(fitted, 6)}


def point_of(row: dict[str, float]) -> MeasuredPoint:
    """The measured point a FitReport row records."""
    prefill, decode = (), ()
    if "prefill_tokens" in row:
        prefill = ((int(row["prefill_tokens"]), int(row["context"])),)
    if "decode_seqs" in row:
        context = int(row.get("decode_context", row["context"]))
        decode = (context,) * int(row["decode_seqs"])
    return MeasuredPoint(StepShape(prefill, decode), row["measured_s"])


def profile_model(
    model: str,
    name: str,
    shapes: Sequence[StepShape],
    repeats: int = 3,
    **profile_fields: object,
) -> SimProfile:
    """Load `model` (anything the engine takes), measure `shapes`, fit a profile that keeps
    the model's tokenizer and KV shape. `profile_fields` set the link, EOS rate and so on."""
    from pdcluster.engine.core import EngineCore  # the real engine, loaded only to be measured
    from pdcluster.engine.presets import resolve_model_dir

    longest = max(n + c for s in shapes for n, c in _rows(s)) + repeats
    block_size = 16
    config = EngineConfig(
        model=resolve_model_dir(model),
        cache=CacheConfig(block_size=block_size, num_blocks=-(-longest // block_size) + 1),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(2048, longest), max_model_len=longest + 1
        ),
    )
    core = EngineCore(config)
    first_id = max(core.tokenizer.special_ids, default=-1) + 1
    points = measure(core.runner, shapes, block_size, first_id, repeats)
    coefficients, fit_report = fit(points)
    info = core.model_info
    kv = KVShape(
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype_bytes=core.runner.kv_cache.element_size(),
    )
    return SimProfile(
        name=name, tokenizer=model, step=coefficients, kv=kv, fit=fit_report, **profile_fields
    )
