"""Benchmark workloads: a replayed trace window or a synthetic Poisson stream, with scaling.

A `Workload` is a list of `RequestSpec` (arrival time, prompt and output lengths, image or
not) plus a `scaling` record that says how it was derived from its source; every figure the
benchmark prints carries `describe()` next to it. Prompts are random token ids from a fixed
seed (the completions API accepts token-id lists), so prompt lengths are exact; requests
carry `ignore_eos` and `max_tokens` = the output length, so output lengths are exact too.
"""

from __future__ import annotations

import base64
import csv
import io
import math
import random
import statistics
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

FIRST_ORDINARY_TOKEN_ID = 6  # the presets' special tokens sit below this id
MAX_RANDOM_TOKEN_ID = 1000  # valid in any vocabulary of at least 1000 tokens
HERE = Path(__file__).resolve().parent
SHARED_TRACE = HERE.parents[1] / "shared" / "traces" / "azure_llm_2023_conv.csv"
PACKAGED_TRACE = HERE / "data" / "azure_llm_2023_conv_sample.csv"
# Common English words: about one token each in the presets' tokenizer (chat prompts are text).
_WORDS = ("the", "a", "and", "of", "to", "in", "is", "it", "that", "for", "on", "with", "as")


def default_trace(shared: Path = SHARED_TRACE) -> Path:
    """The full Azure conv trace where a checkout has it next to it, else the packaged
    2,000-request sample (benchmarks/data/README.md), which every install has."""
    return shared if shared.is_file() else PACKAGED_TRACE


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # since the trace's first request
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float  # since the run's first request
    prompt_len: int
    output_len: int
    has_image: bool = False


@dataclass(frozen=True)
class Workload:
    requests: tuple[RequestSpec, ...]
    scaling: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the arrival span ((n - 1) / span)."""
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0
        return (len(self.requests) - 1) / span if span > 0 else math.inf

    def at_rate(self, rate: float) -> Workload:
        """The same requests retimed to a mean rate of `rate` req/s (burstiness kept)."""
        factor = self.mean_rate / rate
        requests = tuple(replace(r, arrival_s=r.arrival_s * factor) for r in self.requests)
        return Workload(requests, {**self.scaling, "rate_rps": rate})

    def fit(self, max_model_len: int) -> Workload:
        """Cut prompts so that prompt + output fits the model's context."""
        requests = tuple(_fit(r, max_model_len) for r in self.requests)
        changed = sum(a != b for a, b in zip(requests, self.requests))
        return Workload(requests, {**self.scaling, "max_model_len": max_model_len,
                                   "num_cut_to_fit": changed})  # fmt: skip

    def describe(self, with_rate: bool = True) -> str:
        scaling = self.scaling if with_rate else {**self.scaling, "rate_rps": None}
        return describe(scaling)


def _fit(r: RequestSpec, max_model_len: int) -> RequestSpec:
    output_len = min(r.output_len, max_model_len - 1)
    return replace(
        r, prompt_len=min(r.prompt_len, max_model_len - output_len), output_len=output_len
    )


def describe(s: dict[str, Any]) -> str:
    """One line stating the source and every scaling applied."""
    if s.get("source") == "synthetic":
        parts = [f"synthetic Poisson, {s['num_requests']} req, prompt {s['prompt_len']}±"
                 f"{s['jitter']:.0%}, output {s['output_len']}±{s['jitter']:.0%}"]  # fmt: skip
    else:
        parts = [
            f"trace {Path(s['trace']).name} [{s['window_start_s']:g} s +{s['num_requests']} req, "
            f"native {s['native_rate_rps']:.2f} req/s]",
            f"tokens ×{s['token_scale']:g} clamped prompt [{s['min_prompt_len']}, "
            f"{s['max_prompt_len']}] output [{s['min_output_len']}, {s['max_output_len']}]",
        ]
    if s.get("rate_rps") is not None:
        native = s.get("native_rate_rps")
        ratio = f" (×{s['rate_rps'] / native:.3g} trace)" if native else ""
        parts.append(f"rate {s['rate_rps']:.3g} req/s{ratio}")
    if s.get("image_fraction"):
        parts.append(f"images on {s['image_fraction']:.0%}")
    if s.get("num_cut_to_fit"):
        parts.append(f"{s['num_cut_to_fit']} prompts cut to max_model_len {s['max_model_len']}")
    return "; ".join(parts)


# ---- trace ------------------------------------------------------------------------------
def _parse_time(text: str) -> datetime:
    day, _, frac = text.strip().partition(".")
    return datetime.strptime(f"{day}.{(frac or '0')[:6]:0<6}", "%Y-%m-%d %H:%M:%S.%f")


def load_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a TIMESTAMP,ContextTokens,GeneratedTokens CSV, times relative to the first."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {path} not found; pass --trace PATH (a TIMESTAMP,ContextTokens,"
            "GeneratedTokens CSV such as the Azure LLM conv trace) or use --synthetic"
        )
    with path.open(newline="", encoding="utf-8") as f:
        rows = [(_parse_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(f)]  # fmt: skip
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRow((t - t0).total_seconds(), p, g) for t, p, g in rows]


def window(
    rows: list[TraceRow],
    start_s: float = 0.0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[TraceRow]:
    """Rows arriving from `start_s`, at most `num_requests` of them and within `duration_s`;
    arrival times are shifted so the window starts at 0."""
    picked = [r for r in rows if r.arrival_s >= start_s]
    if duration_s is not None:
        picked = [r for r in picked if r.arrival_s < start_s + duration_s]
    if num_requests is not None:
        picked = picked[:num_requests]
    if not picked:
        raise ValueError(f"the trace has no requests in the window starting at {start_s} s")
    t0 = picked[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in picked]


def scale_len(n: int, scale: float, lo: int, hi: int) -> int:
    """round(n × scale) clamped to [lo, hi]."""
    return max(lo, min(hi, round(n * scale)))


@dataclass(frozen=True)
class LengthScaling:
    token_scale: float = 1.0
    min_prompt_len: int = 4
    max_prompt_len: int = 1536
    min_output_len: int = 2  # TPOT needs two tokens
    max_output_len: int = 512


def trace_workload(
    path: str | Path,
    lengths: LengthScaling,
    start_s: float = 0.0,
    num_requests: int | None = None,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
) -> Workload:
    rows = window(load_trace(path), start_s, num_requests, duration_s)
    ls = lengths
    requests = tuple(
        RequestSpec(
            r.arrival_s / rate_scale,
            scale_len(r.prompt_len, ls.token_scale, ls.min_prompt_len, ls.max_prompt_len),
            scale_len(r.output_len, ls.token_scale, ls.min_output_len, ls.max_output_len),
        )
        for r in rows
    )
    span = rows[-1].arrival_s
    native = (len(rows) - 1) / span if span > 0 else math.inf
    scaling = {
        "source": "trace",
        "trace": str(path),
        "window_start_s": start_s,
        "num_requests": len(rows),
        "native_rate_rps": native,
        "native_prompt_len_median": statistics.median(r.prompt_len for r in rows),
        "native_output_len_median": statistics.median(r.output_len for r in rows),
        **lengths.__dict__,
        "rate_scale": rate_scale,
        "rate_rps": native * rate_scale,
    }
    return Workload(requests, scaling)


def synthetic_workload(
    rate: float,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    jitter: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Poisson arrivals at `rate`; lengths uniform in [L × (1 - jitter), L × (1 + jitter)]."""
    rng = random.Random(seed)
    t, requests = 0.0, []
    for _ in range(num_requests):
        requests.append(RequestSpec(t, _jittered(rng, prompt_len, jitter),
                                    max(2, _jittered(rng, output_len, jitter))))  # fmt: skip
        t += rng.expovariate(rate)
    scaling = {"source": "synthetic", "num_requests": num_requests, "prompt_len": prompt_len,
               "output_len": output_len, "jitter": jitter, "seed": seed}  # fmt: skip
    return Workload(tuple(requests), scaling).at_rate(rate)


def _jittered(rng: random.Random, n: int, jitter: float) -> int:
    return max(1, round(n * rng.uniform(1 - jitter, 1 + jitter)))


def with_images(workload: Workload, fraction: float, seed: int = 0) -> Workload:
    """Give each request an image with probability `fraction` (all of them at 1.0)."""
    rng = random.Random(seed + 7919)
    requests = tuple(replace(r, has_image=rng.random() < fraction) for r in workload.requests)
    return Workload(requests, {**workload.scaling, "image_fraction": fraction})


# ---- request bodies ---------------------------------------------------------------------
def token_prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN_ID, MAX_RANDOM_TOKEN_ID) for _ in range(length)]


def png_data_url(seed: int, size: int = 64) -> str:
    """A random-noise PNG (a distinct image per seed, so the encoder cache never hits)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def request_body(spec: RequestSpec, model: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(API path, streaming JSON body) of one request. Text-only requests use the completions
    API with token ids (exact prompt length); image requests use chat with a data: URL and
    `prompt_len` words of text (about one token each)."""
    common: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if not spec.has_image:
        prompt = token_prompt(spec.prompt_len, rng)
        return "/v1/completions", {**common, "prompt": prompt, "max_tokens": spec.output_len}
    words = " ".join(rng.choice(_WORDS) for _ in range(max(1, spec.prompt_len)))
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(rng.randrange(2**31))}},
        {"type": "text", "text": words},
    ]
    return "/v1/chat/completions", {
        **common,
        "messages": [{"role": "user", "content": content}],
        "max_completion_tokens": spec.output_len,
    }
