"""The simulated model runner: the real runner's interface, with the forward pass replaced by
a wait of the profile's modeled step time and deterministic pseudo-random tokens.

Tokens depend only on the request's token history (and its sampling seed), through a rolling
hash, so a request emits the same stream whether one instance runs it or P and D split it.
The KV pool is a tensor of the real layout with a tiny block (one layer, one head, one byte
per element), so handoffs move through the real connectors at a few bytes per block.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.config import CacheConfig
from pdcluster.engine.models.loader import ModelInfo
from pdcluster.engine.outputs import NewRequestData, RunnerOutput, SchedulerOutput, TopLogprobs
from pdcluster.engine.request import MultiModalFeature
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.sim.profile import SimProfile, StepShape, StepTimeModel

_MASK = (1 << 64) - 1
# Sampled tokens get log-probabilities in [ln(1/3), 0): the alternatives then share the
# remaining mass by halves, so every listed alternative is less likely than the sampled one.
_MIN_SAMPLED_LOGPROB = math.log(1 / 3)


def mix(h: int, token_id: int) -> int:
    """One step of the rolling 64-bit hash of a token history (splitmix64 finaliser)."""
    h = (h ^ (token_id + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


def history_hash(token_ids: list[int], seed: int | None) -> int:
    h = mix(0, -1 if seed is None else seed & _MASK)
    for token_id in token_ids:
        h = mix(h, token_id)
    return h


@dataclass
class SimRequestState:
    req_id: str
    num_tokens: int  # prompt, then every token sampled here
    history: int  # rolling hash of those tokens
    # sampled here: min_tokens is what remains of the client's once earlier tokens were
    # generated elsewhere (routing/handoff.py), as the real scheduler's check_stop counts
    num_output_tokens: int
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    num_computed_tokens: int


class SimRunner:
    """Same interface as `ModelRunner` for the engine and the connectors."""

    def __init__(
        self,
        profile: SimProfile,
        info: ModelInfo,
        cache_config: CacheConfig,
        special_ids: frozenset[int],
        time_scale: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.profile = profile
        self.timing = StepTimeModel.of(profile)
        self.time_scale = profile.time_scale if time_scale is None else time_scale
        self.info = info
        self._clock, self._sleep = clock, sleep
        self.eos_token_id = info.eos_token_ids[0] if info.eos_token_ids else None
        excluded = sorted(special_ids | set(info.eos_token_ids))
        self._token_ids = np.setdiff1d(np.arange(info.vocab_size), excluded)  # regular ids
        # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], one byte per element
        self.kv_cache = torch.zeros(
            (cache_config.num_blocks, 1, 2, cache_config.block_size, 1, 1), dtype=torch.uint8
        )
        self.encoder_cache: dict[str, torch.Tensor] = {}  # mm_hash -> [num_embeds, 1]
        self.requests: dict[str, SimRequestState] = {}
        self.num_steps = 0
        self.num_steps_overrun = 0  # the host took longer than the modeled (scaled) step
        self.overrun_s = 0.0
        self.modeled_busy_s = 0.0  # modeled seconds of every step, unscaled

    def transfer_s(self, num_tokens: int) -> float:
        """Wall seconds a P->D load of `num_tokens` tokens takes on the modeled link."""
        return self.timing.transfer_s(num_tokens) * self.time_scale

    # ---- state updates ---------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for new in so.scheduled_new_reqs:
            self._add_new(new)
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.requests[req_id].num_computed_tokens = num_computed

    def _add_new(self, new: NewRequestData) -> None:
        state = self.requests.get(new.req_id)
        if state is not None:  # re-sent after preemption: keep the sampled history
            state.num_computed_tokens = new.num_computed_tokens
            return
        params = new.sampling_params
        self.requests[new.req_id] = SimRequestState(
            req_id=new.req_id,
            num_tokens=len(new.prompt_token_ids),
            history=history_hash(new.prompt_token_ids, params.seed),
            num_output_tokens=0,
            mm_features=new.mm_features,
            sampling_params=params,
            num_computed_tokens=new.num_computed_tokens,
        )

    # ---- one step --------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        start_s = self._clock()
        self._update_states(so)
        num_images = self._fill_encoder_cache(so.scheduled_encoder_inputs)
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        prefill, decode_contexts = [], []
        for s, req_id in zip(states, req_ids):
            n = so.num_scheduled_tokens[req_id]
            if n == 1 and s.num_computed_tokens + 1 >= s.num_tokens:
                decode_contexts.append(s.num_computed_tokens)
            else:
                prefill.append((n, s.num_computed_tokens))
        shape = StepShape(tuple(prefill), tuple(decode_contexts), num_images)
        output = self._sample(req_ids, states, so.num_scheduled_tokens) if req_ids else None
        self._wait_modeled(start_s, self.timing.step_s(shape))
        return output or RunnerOutput()

    def _sample(
        self, req_ids: list[str], states: list[SimRequestState], num_scheduled: dict[str, int]
    ) -> RunnerOutput:
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[float]] = [[] for _ in req_ids]
        top_logprobs: list[list[TopLogprobs]] = [[] for _ in req_ids]
        for i, (req_id, s) in enumerate(zip(req_ids, states)):
            if s.num_computed_tokens + num_scheduled[req_id] < s.num_tokens:
                continue  # a partial prefill chunk samples nothing
            token_id, logprob, top = self._next_token(s)
            s.history, s.num_tokens = mix(s.history, token_id), s.num_tokens + 1
            s.num_output_tokens += 1
            sampled[i], logprobs[i] = [token_id], [logprob]
            top_logprobs[i] = [top] if top is not None else []
        return RunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    def _next_token(self, s: SimRequestState) -> tuple[int, float, TopLogprobs | None]:
        """The token after `s`'s history, its log-probability and the likeliest alternatives."""
        draw = mix(s.history, 0x5EED)
        u = (draw >> 11) / float(1 << 53)  # uniform in [0, 1)
        params = s.sampling_params
        may_end = not params.ignore_eos and s.num_output_tokens >= params.min_tokens
        if may_end and self.eos_token_id is not None and u < self.profile.eos_probability:
            token_id = self.eos_token_id
        else:
            token_id = int(self._token_ids[draw % len(self._token_ids)])
        logprob = _MIN_SAMPLED_LOGPROB * ((draw >> 7) % 1000) / 1000
        if not params.logprobs:
            return token_id, logprob, None
        return token_id, logprob, self._top(token_id, logprob, draw, params.logprobs)

    def _top(self, token_id: int, logprob: float, draw: int, k: int) -> TopLogprobs:
        ids, lps, rest = [token_id], [logprob], 1.0 - math.exp(logprob)
        h = draw
        while len(ids) < k:
            h = mix(h, len(ids))
            alt = int(self._token_ids[h % len(self._token_ids)])
            if alt not in ids:
                rest /= 2
                ids.append(alt)
                lps.append(math.log(max(rest, 1e-30)))
        return TopLogprobs(tuple(ids), tuple(lps))

    # ---- multimodal ------------------------------------------------------------------
    def _fill_encoder_cache(self, scheduled: dict[str, list[int]]) -> int:
        """Stand-in encoder outputs for the scheduled images; returns how many were new."""
        todo = {}
        for req_id, indices in scheduled.items():
            for idx in indices:
                feature = self.requests[req_id].mm_features[idx]
                if feature.mm_hash not in self.encoder_cache:
                    todo[feature.mm_hash] = feature
        for feature in todo.values():
            self.encoder_cache[feature.mm_hash] = torch.zeros((feature.length, 1))
        return len(todo)

    def encode_features(self, features: list[MultiModalFeature]) -> None:
        """An encoder instance's batch: wait the modeled encoder time, keep stand-in outputs."""
        start_s = self._clock()
        for f in features:
            self.encoder_cache[f.mm_hash] = torch.zeros((f.length, 1))  # [num_embeds, 1]
        self._wait_modeled(start_s, self.timing.step_s(StepShape(num_images=len(features))))

    # ---- time --------------------------------------------------------------------------
    def _wait_modeled(self, start_s: float, modeled_s: float) -> None:
        """Sleep until `start_s` + the scaled modeled time; a host already past it overran."""
        if modeled_s <= 0:
            return
        self.num_steps += 1
        self.modeled_busy_s += modeled_s
        deadline_s = start_s + modeled_s * self.time_scale
        late_s = self._clock() - deadline_s
        if late_s > 0:
            self.num_steps_overrun += 1
            self.overrun_s += late_s
        else:
            self._sleep(-late_s)

    def stats(self) -> dict[str, float]:
        return {
            "sim_steps": self.num_steps,
            "sim_steps_overrun": self.num_steps_overrun,
            "sim_overrun_s": round(self.overrun_s, 6),
            "sim_modeled_busy_s": round(self.modeled_busy_s, 6),
            "sim_time_scale": self.time_scale,
        }
