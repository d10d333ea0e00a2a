"""Offline API in the style of vLLM: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from pdcluster.connectors.base import KVConnectorBase
from pdcluster.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdcluster.engine.core import EngineCore
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.outputs import EngineCoreOutput, PromptLogprobs, TopLogprobs
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.engine.processor import InputProcessor, PromptType
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None  # of each sampled token, with SamplingParams.logprobs
    top_logprobs: list[TopLogprobs] | None = None  # per token, with SamplingParams.logprobs > 0
    stop_reason: int | str | None = None
    error: str | None = None  # why, when finish_reason is "error"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def engine_config_from_args(
    model: str,
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None,
    enable_lora: bool = False,
    **engine_args: Any,
) -> EngineConfig:
    """Build an EngineConfig from flat vLLM-style keyword arguments; `speculative_config` in
    vLLM's dict form (e.g. {"method": "ngram", "num_speculative_tokens": 4}); `enable_lora`
    with `max_loras`, `max_lora_rank` and `max_cpu_loras` as vLLM's."""
    groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "engine": {}, "lora": {}}
    owners = {
        "cache": CacheConfig.__dataclass_fields__,
        "scheduler": SchedulerConfig.__dataclass_fields__,
        "lora": LoRAConfig.__dataclass_fields__,
        "engine": {
            "device",
            "dtype",
            "quantization",
            "seed",
            "sim_time_scale",
            "tensor_parallel_size",
            "num_threads",
        },  # fmt: skip
    }
    for key, value in engine_args.items():
        owner = next((g for g, names in owners.items() if key in names), None)
        if owner is None:
            raise TypeError(f"unknown engine argument {key!r}")
        groups[owner][key] = value
    if groups["lora"] and not enable_lora:
        raise ValueError(f"{sorted(groups['lora'])} need enable_lora=True")
    return EngineConfig(
        model=model,
        cache=CacheConfig(**groups["cache"]),
        scheduler=SchedulerConfig(**groups["scheduler"]),
        speculative=None
        if speculative_config is None
        else SpeculativeConfig.from_dict(speculative_config),
        lora=LoRAConfig(**groups["lora"]) if enable_lora else None,
        **groups["engine"],
    )


class LLM:
    """One in-process engine instance (no Ray). `model` is anything `resolve_model_dir` takes:
    a checkpoint folder, a GGUF file, 'smollm2-135m', 'preset:<name>', or None for the
    built-in tiny preset."""

    def __init__(
        self,
        model: str | None = None,
        *,
        kv_connector: KVConnectorBase | None = None,
        **engine_args: Any,
    ) -> None:
        model = resolve_model_dir(model)
        self.engine = EngineCore(engine_config_from_args(model, **engine_args), kv_connector)
        self.tokenizer = self.engine.tokenizer
        self.processor = InputProcessor(model, self.tokenizer, self.engine.model_info)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (under `lora_request`, or each under its own); outputs
        come back in the order of `prompts`."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("need one SamplingParams per prompt, or a single one")
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompt_list)
        )
        if len(loras) != len(prompt_list):
            raise ValueError("need one lora_request per prompt, or a single one")
        results: dict[str, RequestOutput] = {}
        for prompt, params, lora in zip(prompt_list, params_list, loras):
            request = self.processor.process(
                str(next(self._ids)), prompt, params, lora_request=lora
            )
            self.engine.add_request(request)
            results[request.request_id] = new_request_output(request)
        self._run(results, use_tqdm)
        return list(results.values())

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        pending = set(results)
        with tqdm(total=len(pending), disable=not use_tqdm, desc="generate") as bar:
            while pending:
                outputs, _ = self.engine.step()
                for out in outputs:
                    if out.request_id in pending and merge_output(results[out.request_id], out):
                        pending.discard(out.request_id)
                        bar.update(1)
        while self.engine.has_work():  # tell the runner about the last finished requests
            self.engine.step()


def new_request_output(request: Request) -> RequestOutput:
    """An empty result for `request`, filled by `merge_output` as outputs arrive."""
    wanted = request.sampling_params.logprobs
    logprobs = [] if wanted is not None else None
    completion = CompletionOutput(0, "", [], None, logprobs, [] if wanted else None)
    return RequestOutput(request.request_id, request.prompt_token_ids, [completion])


def merge_output(result: RequestOutput, out: EngineCoreOutput) -> bool:
    """Fold one step's output into the request's result; True once it finished."""
    completion = result.outputs[0]
    completion.token_ids.extend(out.new_token_ids)
    completion.text += out.new_text
    if completion.logprobs is not None and out.new_logprobs:
        completion.logprobs.extend(out.new_logprobs)
    if completion.top_logprobs is not None and out.new_top_logprobs:
        completion.top_logprobs.extend(out.new_top_logprobs)
    result.num_cached_tokens = out.num_cached_tokens
    if out.prompt_logprobs is not None:
        result.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        completion.finish_reason = out.finish_reason
        completion.stop_reason = out.stop_reason
        completion.error = out.error
    return out.finished


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # a single prompt given as token ids
    return list(prompts)
