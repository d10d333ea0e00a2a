"""EncoderCore: the encoder-only instance (role E).

It schedules images first-come first-served under a per-step embedding budget, runs the
vision encoder on each batch, and hands every output to the EC connector (the producer
side), keeping nothing: an encoder instance holds no KV cache and no finished state.
"""

from __future__ import annotations

from collections import deque

from pdcluster.connectors.base import ECConnectorBase
from pdcluster.engine.config import CacheConfig, EngineConfig
from pdcluster.engine.core import resolve_device
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.models.loader import load_model, read_model_info
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.precision import Precision
from pdcluster.engine.request import MultiModalFeature, Request
from pdcluster.engine.sim.profile import read_folder_profile
from pdcluster.engine.sim.runner import SimRunner
from pdcluster.engine.structured_output import GrammarCompiler
from pdcluster.engine.tokenizer import Tokenizer


class EncoderCore:
    """Same stepping contract as EngineCore: add_request, abort_requests, step, has_work."""

    def __init__(self, config: EngineConfig, ec_connector: ECConnectorBase) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        precision = Precision.resolve(config.dtype, config.quantization, self.device)
        self.dtype = precision.dtype
        self.model_info = read_model_info(config.model)
        if not self.model_info.is_multimodal:
            raise ValueError(f"an encoder instance needs a multimodal model, not {config.model}")
        # The runner needs a KV pool; an encoder never uses it, so it gets one block.
        tiny_pool = CacheConfig(block_size=config.cache.block_size, num_blocks=1)
        tokenizer = Tokenizer(config.model)
        profile = read_folder_profile(config.model)
        if profile is not None:
            self.runner = SimRunner(
                profile, self.model_info, tiny_pool, tokenizer.special_ids, config.sim_time_scale
            )
        else:
            model, self.model_info = load_model(config.model, self.device, self.dtype)
            grammars = GrammarCompiler(tokenizer, self.model_info.vocab_size)  # unused
            self.runner = ModelRunner(
                model, self.model_info, tiny_pool, self.device, precision, grammars
            )  # fmt: skip
        self.ec_connector = ec_connector
        self.budget = config.scheduler.encoder_compute_budget
        self.waiting: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        if not request.mm_features:
            raise ValueError("an encoder instance only takes requests with images")
        if not all(f.has_pixels for f in request.mm_features):
            raise ValueError("every image sent to an encoder instance needs its pixels")
        if any(r.request_id == request.request_id for r in self.waiting):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self.waiting = deque(r for r in self.waiting if r.request_id not in gone)

    def fail_all(self) -> list[str]:
        """Abort every request (after a step raised, or at shutdown); returns their ids."""
        request_ids = self.request_ids()
        self.waiting.clear()
        return request_ids

    def has_work(self) -> bool:
        return bool(self.waiting)

    def waits_only_on_remote(self) -> bool:
        return False  # an encoder waits on nothing remote

    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.waiting]

    def _take_batch(self) -> list[Request]:
        """FCFS requests whose embeddings fit the budget (always at least one)."""
        batch = [self.waiting.popleft()]
        used = sum(f.length for f in batch[0].mm_features)
        while self.waiting:
            need = sum(f.length for f in self.waiting[0].mm_features)
            if used + need > self.budget:
                break
            batch.append(self.waiting.popleft())
            used += need
        return batch

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """Encode one batch and publish each output; every request in it finishes."""
        if not self.waiting:
            return [], False
        batch = self._take_batch()
        unique: dict[str, MultiModalFeature] = {}
        for request in batch:
            for f in request.mm_features:
                unique.setdefault(f.mm_hash, f)
        try:
            self.runner.encode_features(list(unique.values()))
        except (ValueError, RuntimeError) as exc:  # bad pixels: fail this batch, keep serving
            return [_finished(r.request_id, "error", str(exc)) for r in batch], True
        for mm_hash in unique:
            self.ec_connector.save_caches(self.runner.encoder_cache, mm_hash)
            self.runner.encoder_cache.pop(mm_hash, None)
        return [_finished(r.request_id, "stop") for r in batch], True

    def stats(self) -> dict[str, int | float]:
        stats = {"num_waiting": len(self.waiting), "num_blocks_total": 0, "num_blocks_free": 0}
        return {**stats, **getattr(self.runner, "stats", dict)()}

    def shutdown(self) -> None:
        self.ec_connector.shutdown()


def _finished(request_id: str, reason: str, error: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason=reason, error=error)
