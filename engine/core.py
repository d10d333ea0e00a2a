"""EngineCore: one instance's scheduler, model runner and connectors, stepped by its owner."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch

from pdcluster.connectors.base import ECConnectorBase, KVConnectorBase
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv_budget import GiB, size_cache
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.lora.manager import LoRAManager, LoRAStats
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.models.loader import ModelInfo, load_model, read_model_info
from pdcluster.engine.outputs import (
    EngineCoreOutput,
    KVConnectorOutput,
    RunnerOutput,
    SchedulerOutput,
)
from pdcluster.engine.parallel import check_tp_size, shard_model
from pdcluster.engine.precision import Precision
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.sim.profile import read_folder_profile, sim_cache
from pdcluster.engine.sim.runner import SimRunner
from pdcluster.engine.spec_decode.draft_model import Drafter, load_draft_model
from pdcluster.engine.structured_output import GrammarCompiler
from pdcluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdcluster.engine.tp_worker import (
    TensorParallelGroup,
    WorkerLauncher,
    local_info,
    start_processes,
)

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class EngineCore:
    """Steps one instance. Not thread-safe: its owner calls every method from one thread."""

    def __init__(
        self,
        config: EngineConfig,
        kv_connector: KVConnectorBase | None = None,
        ec_connector: ECConnectorBase | None = None,
        tp_launcher: WorkerLauncher = start_processes,  # starts ranks 1.. when sharded
    ) -> None:
        self.tp_launcher = tp_launcher
        self.tp: TensorParallelGroup | None = None
        if config.num_threads is not None:  # before loading: the load-time races use them
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.precision = Precision.resolve(config.dtype, config.quantization, self.device)
        self.dtype = self.precision.dtype
        torch.manual_seed(config.seed)
        self.tokenizer = Tokenizer(config.model)
        self.sim_profile = read_folder_profile(config.model)
        self.runner = self._make_runner(config)
        self.config = config = dataclasses.replace(config, cache=self.runner_cache)
        cache = config.cache
        logger.info(
            "KV cache: %d blocks x %d tokens, %.3f GiB on %s",
            cache.num_blocks, cache.block_size, self.runner.kv_cache.nbytes / GiB, self.device,
        )  # fmt: skip
        self.scheduler = Scheduler(
            config.scheduler, config.cache, kv_connector, ec_connector, config.speculative,
            None if config.lora is None else config.lora.max_loras,
        )  # fmt: skip
        self.kv_connector = kv_connector
        self.ec_connector = ec_connector
        if kv_connector is not None:
            draft_kv = None if self.drafter is None else self.drafter.kv_cache
            kv_connector.register_kv_caches(self.runner.kv_cache, draft_kv)
            if self.tp is not None:
                kv_connector.register_head_shards(self.tp)
            if isinstance(self.runner, SimRunner):
                kv_connector.set_modeled_transfer(self.runner.transfer_s)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def _make_runner(self, config: EngineConfig) -> ModelRunner | SimRunner:
        """The real runner, or a simulated one for a `sim:` folder; sets `model_info`,
        `grammars`, `runner_cache` (the cache config with its block count fixed) and
        `drafter` (the draft model's, speculative method draft_model) and `lora` (its
        adapters, with enable_lora)."""
        self.drafter: Drafter | None = None
        self.lora: LoRAManager | None = None
        if self.sim_profile is not None:
            if config.lora is not None:
                raise ValueError("LoRA: a simulated model (sim:) has no layers to adapt")
            if config.speculative is not None:
                raise ValueError(
                    "speculative_config: a simulated model (sim:) cannot verify drafts"
                )
            self.model_info = read_model_info(config.model)
            self.runner_cache = sim_cache(config.cache, self.sim_profile)
            self.grammars = GrammarCompiler(self.tokenizer, self.model_info.vocab_size)
            special_ids = self.tokenizer.special_ids
            return SimRunner(
                self.sim_profile, self.model_info, self.runner_cache, special_ids,
                config.sim_time_scale,
            )  # fmt: skip
        model, self.model_info = load_model(config.model, self.device, self.dtype)
        runner_info = self._shard(config, model)
        draft = None
        infos, models = [runner_info], [model]
        if config.draft_model is not None:
            draft = load_draft_model(
                config.draft_model, self.tokenizer, config.dtype, config.quantization, self.device
            )
            infos.append(draft.info)
            models.append(draft.model)
        self.runner_cache = size_cache(config.cache, infos, self.dtype, self.device, models)
        if self.tp is not None:
            self.tp.start_cache(self.runner_cache)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_info.vocab_size)
        if draft is not None:
            vocab_size = self.model_info.vocab_size
            self.drafter = Drafter(draft, self.runner_cache, vocab_size, self.device)
        runner = ModelRunner(
            model, runner_info, self.runner_cache, self.device, self.precision, self.grammars,
            self.tp, self.drafter, config.lora,
        )  # fmt: skip
        self.lora = runner.lora
        if self.tp is not None:
            self.tp.attach_kv_cache(runner.kv_cache, self.model_info.num_kv_heads)
        return runner

    def _shard(self, config: EngineConfig, model: torch.nn.Module) -> ModelInfo:
        """With tensor_parallel_size > 1: start the other ranks and keep rank 0's shard of
        `model`. Returns the model info this rank's KV cache follows."""
        size = config.tensor_parallel_size
        check_tp_size(model, size)
        if size == 1:
            return self.model_info
        self.tp = TensorParallelGroup(
            config.model, self.device, self.precision, size, self.tp_launcher
        )
        shard_model(model, self.tp.comm)
        return local_info(self.model_info, self.tp.comm)

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (and changes nothing) when it cannot be served."""
        self._validate(request)
        self._detokenizers[request.request_id] = self._detokenizer(request)
        self.scheduler.add_request(request)

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        """The request's detokenizer; one continuing earlier output whose text the client
        got (`prior_output_text`) goes on from that text."""
        params = request.sampling_params
        prompt, num_prior = request.prompt_token_ids, request.num_prior_output_tokens
        sent_text = request.prior_output_text if num_prior else None
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prompt if sent_text is None else prompt[:-num_prior],
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        if sent_text is not None:
            detok.go_on_from(prompt[-num_prior:], sent_text)
        return detok

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in any state; a producer also stops holding the KV for a remote reader."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.kv_connector is not None:
            self.kv_connector.cancel_sends(request_ids)
        for req_id in request_ids:
            self._detokenizers.pop(req_id, None)

    def fail_all(self) -> list[str]:
        """After a step raised: abort every request (returned) and forget every cached
        prefix, since blocks the failed step wrote may hold partial KV."""
        request_ids = self.request_ids()
        self.abort_requests(request_ids)
        self.scheduler.kv_cache_manager.block_pool.forget_prefixes()
        return request_ids

    def _validate(self, request: Request) -> None:
        max_len = self.config.scheduler.max_model_len
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; this model serves at most "
                f"{max_len} tokens including at least one generated token"
            )
        vocab = self.model_info.vocab_size
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        outside = [t for t in request.sampling_params.logit_bias if t >= vocab]
        if outside:
            raise ValueError(
                f"logit_bias: token id {outside[0]} is outside this model's vocabulary [0, {vocab})"
            )
        if request.mm_features and not self.model_info.is_multimodal:
            raise ValueError("this model does not accept images")
        structured = request.sampling_params.structured_outputs
        if structured is not None and self.sim_profile is not None:
            raise ValueError("structured_outputs: a simulated model (sim:) cannot honour them")
        if structured is not None:
            self.grammars.matcher(structured)  # compiled (and cached for the runner) now
        lora = request.lora_request
        if lora is not None:
            if self.lora is None:
                raise ValueError(
                    f"LoRA adapter {lora.name!r}: this instance serves no adapters (enable_lora)"
                )
            self.lora.use(lora)  # read now (LoRAAdapterError when it cannot be served)

    # ---- LoRA adapters (any thread) ------------------------------------------------------
    def load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter for requests to come; ValueError when it cannot be served here."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora.name!r}: this instance serves no adapters")
        self.lora.load(lora)

    def unload_lora(self, name: str) -> bool:
        """Forget an adapter (its running requests finish); whether it was loaded."""
        return self.lora is not None and self.lora.unload(name)

    def has_work(self) -> bool:
        kv_pending = self.kv_connector is not None and self.kv_connector.has_pending()
        return self.scheduler.has_requests() or kv_pending

    def waits_only_on_remote(self) -> bool:
        """Nothing to compute until a remote event: every unfinished request is deferred on
        encoder outputs in flight, and every finished one holds KV for a consumer's ack.
        Both events wake the caller (the EC connector's `wake`, an `ack_kv` call); their
        timeouts and leases can be checked at leisure."""
        s, kv, ec = self.scheduler, self.kv_connector, self.ec_connector
        return (
            not s.running
            and not s.waiting
            and not s.finished_req_ids
            and (kv is None or not kv.needs_polling())
            and all(ec is not None and ec.awaits_outputs(r.request_id) for r in s.skipped_waiting)
        )

    def enable_kv_events(self) -> None:
        self.scheduler.kv_cache_manager.block_pool.enable_kv_events()

    def take_kv_events(self) -> list[tuple[bool, int]]:
        """(stored, block hash) changes of the prefix cache since the last call."""
        return self.scheduler.kv_cache_manager.block_pool.take_kv_events()

    def request_ids(self) -> list[str]:
        """Every request this instance holds state for, finished-but-held ones included."""
        return list(self.scheduler.requests)

    def stats(self) -> dict[str, object]:
        """The plain counters of the scheduler, runner and workers, the KV cache's size, and
        the typed parts: what the KV connector reports (`KVConnectorStats`, its pending counts
        replacing the scheduler's), the EC connector's `ECStats` under `ec` and the drafts'
        `SpecDecodingStats` under `spec_decode` (where this core has them)."""
        stats = {**self.scheduler.stats(), "kv_cache_bytes": self.runner.kv_cache.nbytes}
        for part in (self.runner, self.tp):
            stats.update(getattr(part, "stats", dict)())
        if self.kv_connector is not None:
            stats.update(self.kv_connector.stats().reported())
        if self.ec_connector is not None:
            stats["ec"] = self.ec_connector.stats()
        if self.lora is not None:
            stats["lora"] = self._lora_stats()
        if self.scheduler.speculation is not None:
            caught_up = 0 if self.drafter is None else self.drafter.num_catch_up_tokens
            stats["spec_decode"] = self.scheduler.speculation.stats.snapshot(caught_up)
        return stats

    def _lora_stats(self) -> LoRAStats:
        s = self.scheduler

        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.name for r in requests if r.lora_request}))

        return LoRAStats(
            self.config.lora.max_loras,
            running=names(s.running),
            waiting=names([*s.waiting, *s.skipped_waiting]),
            resident=self.lora.resident(),
            served=tuple(self.lora.served()),
        )

    # ---- one step --------------------------------------------------------------------
    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """Schedule, run the model if anything was scheduled, poll connectors, update.

        Remote KV loads of newly arrived requests are started first, in a pass that runs no
        model: one whose data is already local lands there, so its request is scheduled in
        this step rather than the next (see `Scheduler.schedule_remote_loads`)."""
        early = self.scheduler.schedule_remote_loads()
        outputs = [] if early is None else self._run(early)
        so = self.scheduler.schedule()
        outputs += self._run(so)
        model_executed = so.total_num_scheduled_tokens > 0 or bool(so.scheduled_encoder_inputs)
        return self._process_outputs(outputs), model_executed

    def _run(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Start the connectors' loads, run the model on `so`, poll connectors, update."""
        if self.ec_connector is not None:
            self.ec_connector.start_load_caches(so.ec_connector_metadata, self.runner.encoder_cache)
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(so.kv_connector_metadata)
        runner_output = self.runner.execute_model(so)
        self._after_model(so, runner_output)
        return self.scheduler.update_from_output(so, runner_output)

    def _after_model(self, so: SchedulerOutput, runner_output: RunnerOutput) -> None:
        if self.ec_connector is not None:
            for req_id, indices in so.scheduled_encoder_inputs.items():
                features = self.runner.requests[req_id].mm_features
                for idx in indices:
                    self.ec_connector.save_caches(self.runner.encoder_cache, features[idx].mm_hash)
            self.ec_connector.get_finished(so.finished_req_ids)
        if self.kv_connector is not None:
            self.kv_connector.save_kv(so.kv_connector_metadata)
            self.kv_connector.wait_for_save()
            sending, recving = self.kv_connector.get_finished(so.finished_req_ids)
            runner_output.kv_connector_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                failed_recving=self.kv_connector.get_failed_loads(),
            )

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Detokenize, apply stop strings, and forget finished requests' detokenizers."""
        for out in outputs:
            detok = self._detokenizers.get(out.request_id)
            if detok is None:
                continue
            out.new_text, stop_str = _detokenize(detok, out)
            if stop_str is not None and not out.finished:
                self.scheduler.finish_requests(out.request_id, RequestStatus.FINISHED_STOPPED)
                out.finish_reason, out.stop_reason = "stop", stop_str
            if out.finished:
                del self._detokenizers[out.request_id]
        return outputs

    def shutdown(self) -> None:
        if self.tp is not None:
            self.tp.shutdown()
            self.tp = None
        for connector in (self.kv_connector, self.ec_connector):
            if connector is not None:
                connector.shutdown()


def _detokenize(detok: IncrementalDetokenizer, out: EngineCoreOutput) -> tuple[str, str | None]:
    """`out`'s text delta and the stop string it hit, if any. Several new tokens (verified
    drafts) with stop strings are fed one by one, as steps of one token would feed them, and
    `out` is cut after the token that completes a stop string."""
    token_ids = out.new_token_ids
    if len(token_ids) < 2 or not detok.stop:
        return detok.update(token_ids, final=out.finished)
    text = ""
    for j, token_id in enumerate(token_ids):
        delta, stop_str = detok.update((token_id,), final=out.finished and j == len(token_ids) - 1)
        text += delta
        if stop_str is not None:
            if j + 1 < len(token_ids):
                _truncate(out, j + 1)
                if out.finished:  # by a token after the stop string: the stop string ends it
                    out.finish_reason, out.stop_reason = "stop", stop_str
            return text, stop_str
    return text, None


def _truncate(out: EngineCoreOutput, num_tokens: int) -> None:
    """Keep the first `num_tokens` new tokens of `out` (and their logprobs)."""
    out.new_token_ids = out.new_token_ids[:num_tokens]
    if out.new_logprobs is not None:
        out.new_logprobs = out.new_logprobs[:num_tokens]
    if out.new_top_logprobs is not None:
        out.new_top_logprobs = out.new_top_logprobs[:num_tokens]
