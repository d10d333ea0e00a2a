"""Runs one step's batch through the model: encoder inputs, one forward, sampling.

A decode request scheduled with draft tokens (`scheduled_spec_decode_tokens`) is a chunk of
its last token and the drafts; it samples at every position of the chunk, and emits the
tokens `engine.spec_decode.verify` keeps. With a draft model the scheduler's drafts are
slots, filled here first (engine.spec_decode.draft_model).

The runner keeps its own per-request state, built from the scheduler's typed messages;
it never reads the scheduler's queues or mutates a `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from pdcluster.engine.attention import AttentionMetadata, allocate_kv_cache
from pdcluster.engine.config import CacheConfig, LoRAConfig
from pdcluster.engine.kernels import cpu_kernels
from pdcluster.engine.lora.adapter import LoRAAdapter
from pdcluster.engine.lora.layers import adaptable_shapes
from pdcluster.engine.lora.manager import LoRAManager
from pdcluster.engine.models.decode_kernel import attach_decode_kernels
from pdcluster.engine.models.loader import ModelInfo
from pdcluster.engine.models.tiered_linear import prepare_linears
from pdcluster.engine.outputs import (
    NewRequestData,
    PromptLogprobs,
    RunnerOutput,
    SchedulerOutput,
)
from pdcluster.engine.penalties import LogitBias, LogitsAdjustments, TokenCounts
from pdcluster.engine.precision import Precision
from pdcluster.engine.request import MultiModalFeature
from pdcluster.engine.sampler import make_generator, position_seed, prompt_logprobs, sample
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.spec_decode.verify import num_accepted
from pdcluster.engine.structured_output import GrammarCompiler, advance
from pdcluster.engine.token_masks import TokenMasks
from pdcluster.engine.tp_worker import StepInputs, TensorParallelGroup

if TYPE_CHECKING:
    from pdcluster.engine.spec_decode.draft_model import Drafter


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt, then every token sampled here
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    grammar: llguidance.LLMatcher | None  # advanced past every token sampled here
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int  # of the user's prompt: `token_ids` after it are the output
    # prompt_logprobs: positions [0, this) had theirs reported (each is reported once, also
    # when a preempted request computes its prompt again)
    num_prompt_logprob_positions: int = 0
    # speculative method draft_model: positions [0, this) hold valid draft KV, as far as
    # the target's KV is valid too (engine.spec_decode.draft_model)
    num_draft_computed: int = 0
    sends_kv: bool = False  # see NewRequestData.sends_kv
    lora: LoRAAdapter | None = None  # the adapter it runs under, its weights held

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def prepare_model(model: torch.nn.Module, precision: Precision, device: torch.device) -> None:
    """Ready a loaded model for `precision` on `device`: on CPU its linear layers packed once,
    each in the format that measured fastest, and its decode kernels attached."""
    quantization = precision.quantization
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on CPU only (device {device})")
    if device.type == "cpu":
        prepare_linears(model, quantization, precision.linear_dtypes)
        cpu_kernels()  # built now (once per machine), not in a step
        attach_decode_kernels(model)  # whole layers in one call where they can run


PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are held at once: [rows, vocab]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        cache_config: CacheConfig,
        device: torch.device,
        precision: Precision,
        grammars: GrammarCompiler,
        tp: TensorParallelGroup | None = None,  # the other ranks, when sharded
        drafter: Drafter | None = None,  # fills draft slots (speculative method draft_model)
        lora: LoRAConfig | None = None,  # LoRA adapters on `model`'s projections
    ) -> None:
        shapes = adaptable_shapes(model) if lora is not None else {}  # as loaded
        prepare_model(model, precision, device)
        self.model = model
        self.lora = None if lora is None else LoRAManager(model, shapes, lora, precision.dtype)
        self.drafter = drafter
        self.tp = tp
        self.grammars = grammars
        self.info = info
        self.device = device
        self.dtype = dtype = precision.dtype
        self.block_size = cache_config.block_size
        self.kv_cache = allocate_kv_cache(
            cache_config.num_blocks, cache_config.block_size, info, dtype, device
        )
        self.encoder_cache: dict[str, torch.Tensor] = {}  # mm_hash -> [num_embeds, hidden]
        self.requests: dict[str, CachedRequestState] = {}
        self.token_counts = TokenCounts(info.vocab_size, device)  # requests with penalties

    # ---- state updates ---------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.token_counts.remove(req_id)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for new in so.scheduled_new_reqs:
            self._add_new(new)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            new_block_ids = cached.new_block_ids[i]
            num_trimmed = cached.num_trimmed_blocks[i]
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(new_block_ids or [])
                state.num_draft_computed = 0
            else:
                if num_trimmed:
                    del state.block_ids[-num_trimmed:]
                if new_block_ids:
                    state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _add_new(self, new: NewRequestData) -> None:
        state = self.requests.get(new.req_id)
        if state is not None:  # re-sent after preemption: keep sampled tokens and RNG state
            state.block_ids = list(new.block_ids)
            state.num_computed_tokens = new.num_computed_tokens
            state.num_draft_computed = 0
            return
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids),
            mm_features=new.mm_features,
            sampling_params=new.sampling_params,
            generator=make_generator(new.sampling_params.seed, self.device),
            grammar=self._new_grammar(new.sampling_params),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            num_prompt_tokens=len(new.prompt_token_ids) - new.num_prior_output_tokens,
            num_draft_computed=new.num_draft_computed_tokens,
            sends_kv=new.sends_kv,
            lora=None if new.lora_request is None else self.lora.get(new.lora_request),
        )
        if new.sampling_params.has_penalties:
            state = self.requests[new.req_id]
            prompt = new.prompt_token_ids[: state.num_prompt_tokens]
            self.token_counts.add(new.req_id, prompt, state.output_token_ids)

    def _new_grammar(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        structured = params.structured_outputs
        return None if structured is None else self.grammars.matcher(structured)

    # ---- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        self._update_states(so)
        self._run_encoders(so.scheduled_encoder_inputs)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return RunnerOutput()
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        meta = AttentionMetadata.build(
            [s.num_computed_tokens for s in states],
            num_scheduled,
            [s.block_ids for s in states],
            self.block_size,
            self.device,
        )
        drafts = so.scheduled_spec_decode_tokens
        if self.drafter is not None:
            # a prompt whose KV is sent: the draft's KV computed beside, and sent with it
            ends = [(s, s.num_computed_tokens + n) for s, n in zip(states, num_scheduled)]
            self.drafter.follow([(s, end) for s, end in ends if s.sends_kv])
            if drafts:
                drafts = self.drafter.propose(self.requests, drafts)
        input_ids: list[int] = []
        for s, n in zip(states, num_scheduled):
            draft = drafts.get(s.req_id, ())
            num_known = n - len(draft)  # the drafts follow the request's known tokens
            input_ids.extend(s.token_ids[s.num_computed_tokens : s.num_computed_tokens + num_known])
            input_ids.extend(draft)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
        if self.tp is not None:
            tables = [s.block_ids for s in states]
            computed = [s.num_computed_tokens for s in states]
            self.tp.start_step(StepInputs(input_ids, computed, num_scheduled, tables))
        if self.lora is not None:
            self.lora.prepare([s.lora for s in states], num_scheduled)
        embeds = self.model.embed_tokens(ids)  # [T, hidden]
        if self.info.is_multimodal:
            self._merge_encoder_outputs(embeds, states, num_scheduled)
        hidden = self.model.forward(embeds, meta.positions, self.kv_cache, meta)  # [T, hidden]
        prompt_lps = self._prompt_logprobs(req_ids, states, num_scheduled, hidden)
        out = self._sample(req_ids, states, num_scheduled, hidden, meta.logits_indices, drafts)
        out.prompt_logprobs = prompt_lps
        return out

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        num_scheduled: list[int],
        hidden: torch.Tensor,  # [T, hidden]: every scheduled token, request after request
    ) -> dict[str, PromptLogprobs]:
        """For requests asking prompt_logprobs: the prompt tokens predicted by this step's
        positions (position p predicts token p + 1), each prompt token once."""
        found: dict[str, PromptLogprobs] = {}
        start = 0  # this request's first row in `hidden`
        for rid, s, n in zip(req_ids, states, num_scheduled):
            num_top = s.sampling_params.prompt_logprobs
            lo = s.num_computed_tokens
            first = max(lo, s.num_prompt_logprob_positions)
            end = min(lo + n, s.num_prompt_tokens - 1)
            if num_top is not None and first < end:
                result = PromptLogprobs()
                for a in range(first, end, PROMPT_LOGITS_ROWS):
                    b = min(a + PROMPT_LOGITS_ROWS, end)
                    logits = self.model.compute_logits(hidden[start + a - lo : start + b - lo])
                    result.extend(prompt_logprobs(logits, s.token_ids[a + 1 : b + 1], num_top))
                found[rid] = result
                s.num_prompt_logprob_positions = end
            start += n
        return found

    def _sample(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        num_scheduled: list[int],
        hidden: torch.Tensor,  # [T, hidden]: every scheduled token, request after request
        last_rows: torch.Tensor,  # [num_reqs] long: each request's last row in `hidden`
        drafts: dict[str, list[int]],  # req_id -> draft tokens it verifies
    ) -> RunnerOutput:
        # Only requests whose known tokens are all computed after this step sample a token.
        picked = [
            i
            for i, (s, n) in enumerate(zip(states, num_scheduled))
            if s.num_computed_tokens + n >= len(s.token_ids)
        ]
        out = RunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
            logprobs=[[] for _ in req_ids],
            top_logprobs=[[] for _ in req_ids],
        )
        if picked:
            self._sample_rows([(i, states[i], drafts.get(req_ids[i], [])) for i in picked],
                hidden, last_rows.tolist(), out)  # fmt: skip
        return out

    def _sample_rows(
        self,
        picked: list[tuple[int, CachedRequestState, list[int]]],  # (batch index, state, drafts)
        hidden: torch.Tensor,  # [T, hidden]
        last_rows: list[int],  # per batch index: its last row in `hidden`
        out: RunnerOutput,  # filled at the picked indices
    ) -> None:
        """Sample one row per picked request, or K + 1 for one verifying K drafts (its last
        K + 1 positions), in one `sample` call; append what each emits."""
        row_index: list[int] = []  # per sampled row: its row in `hidden`
        rows: list[tuple[CachedRequestState, list[int]]] = []  # and (state, drafts before it)
        for i, s, draft in picked:
            for j in range(len(draft) + 1):
                row_index.append(last_rows[i] - len(draft) + j)
                rows.append((s, draft[:j]))
        logits = self.model.compute_logits(hidden[row_index])  # [num_rows, vocab]
        sampler_out = sample(
            logits,
            [s.sampling_params for s, _ in rows],
            self._generators(rows),
            self._adjustments(rows),
            self.grammars.bitmask([s.grammar for s, _ in rows], [before for _, before in rows]),
        )
        token_ids = sampler_out.token_ids
        counted_ids: list[str] = []  # per emitted token: its request, for the penalties
        counted_tokens: list[int] = []
        start = 0  # this request's first sampled row
        for i, s, draft in picked:
            targets = token_ids[start : start + len(draft) + 1]
            end = start + num_accepted(draft, targets) + 1  # the accepted drafts, one more
            if s.grammar is not None:
                end = start + self._advance_grammar(s, token_ids[start:end], out)
            tokens = token_ids[start:end]
            s.token_ids.extend(tokens)
            out.sampled_token_ids[i] = tokens
            out.logprobs[i] = sampler_out.logprobs[start:end]
            out.top_logprobs[i] = [t for t in sampler_out.top_logprobs[start:end] if t is not None]
            counted_ids += [s.req_id] * len(tokens)
            counted_tokens += tokens
            start += len(draft) + 1
        self.token_counts.append(counted_ids, counted_tokens)

    @staticmethod
    def _advance_grammar(s: CachedRequestState, tokens: list[int], out: RunnerOutput) -> int:
        """Advance the request's grammar through its emitted tokens; how many it keeps: up
        to the one that completes the grammar, which ends the request."""
        for j, token_id in enumerate(tokens):
            if advance(s.grammar, token_id):
                out.grammar_done_req_ids.add(s.req_id)
                return j + 1
        return len(tokens)

    def _generators(
        self, rows: list[tuple[CachedRequestState, list[int]]]
    ) -> list[torch.Generator | None]:
        """Each sampled row's generator, seeded for its position: a seeded request draws
        each token from its position's seed (`position_seed`), drafts or not."""
        generators = []
        for s, before in rows:
            generator = s.generator
            if generator is not None:
                if before:  # a later row of the same request: a draw of its own
                    generator = torch.Generator(device=self.device)
                position = len(s.token_ids) + len(before)
                generator.manual_seed(position_seed(s.sampling_params.seed, position))
            generators.append(generator)
        return generators

    def _adjustments(
        self, rows: list[tuple[CachedRequestState, list[int]]]
    ) -> LogitsAdjustments | None:
        """Logit bias, token masks and penalties of the sampled rows, each as if the drafts
        before it were generated; None when no row has any."""
        params = [s.sampling_params for s, _ in rows]
        drafted = [before for _, before in rows]
        bias = LogitBias.build(params, self.device)
        penalties = self.token_counts.penalties([s.req_id for s, _ in rows], params, drafted)
        masks = None
        if any(p.allowed_token_ids is not None or p.bad_words_token_ids for p in params):
            outputs = [s.output_token_ids + before for s, before in rows]
            masks = TokenMasks.build(params, outputs, self.info.vocab_size, self.device)
        if bias is None and penalties is None and masks is None:
            return None
        return LogitsAdjustments(bias, penalties, masks)

    # ---- multimodal ------------------------------------------------------------------
    def _run_encoders(self, scheduled: dict[str, list[int]]) -> None:
        """Encode the scheduled images (all in one batch) into the encoder cache."""
        todo: dict[str, MultiModalFeature] = {}
        for req_id, indices in scheduled.items():
            for idx in indices:
                feature = self.requests[req_id].mm_features[idx]
                if feature.mm_hash not in self.encoder_cache:
                    todo[feature.mm_hash] = feature
        if not todo:
            return
        self.encode_features(list(todo.values()))

    @torch.inference_mode()
    def encode_features(self, features: list[MultiModalFeature]) -> None:
        """Run the vision encoder on `features` and keep the outputs by mm_hash."""
        for f in features:
            if not f.has_pixels:
                raise ValueError(f"image {f.mm_hash} has no pixels and no loaded encoder output")
        pixels = torch.stack([f.pixels() for f in features]).to(self.device, self.dtype)
        embeds = self.model.embed_images(pixels)  # [num_images, num_image_tokens, hidden]
        for f, emb in zip(features, embeds):
            if emb.shape[0] != f.length:
                raise ValueError(
                    f"image {f.mm_hash} has {f.length} placeholders but {emb.shape[0]} embeddings"
                )
            self.encoder_cache[f.mm_hash] = emb

    def _merge_encoder_outputs(
        self, embeds: torch.Tensor, states: list[CachedRequestState], num_scheduled: list[int]
    ) -> None:
        """Overwrite placeholder rows of `embeds` [T, hidden] with encoder outputs."""
        start = 0  # first row of this request in the flattened batch
        for s, n in zip(states, num_scheduled):
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + n
            for f in s.mm_features:
                a, b = max(lo, f.offset), min(hi, f.end)
                if a < b:
                    enc = self.encoder_cache[f.mm_hash]  # [f.length, hidden]
                    embeds[start + a - lo : start + b - lo] = enc[a - f.offset : b - f.offset]
            start += n
