"""What every generating endpoint shares: turning a validated body into engine requests
(sampling params, context checks, n/best_of groups, grammars, images, chat templates) and
logprob tokens into text. Driving the requests on the cluster: runner.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import urllib.request
import uuid
from functools import cached_property
from typing import Any
from urllib.parse import urlparse

from fastapi import Request

from pdcluster.cluster.api.body import BodyT, parse_body
from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.chat_render import ChatRenderer
from pdcluster.cluster.api.cluster_client import ClusterClient
from pdcluster.cluster.api.completions_protocol import CompletionRequest
from pdcluster.cluster.api.errors import APIError
from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.cluster.api.results import Group, Result
from pdcluster.cluster.api.runner import GroupRunner
from pdcluster.cluster.api.tool_parsers import ToolParser, tool_parser
from pdcluster.cluster.config import GatewaySettings
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.multimodal import decode_data_url, load_image
from pdcluster.engine.outputs import TopLogprobs
from pdcluster.engine.request import Request as EngineRequest
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.structured_output import GrammarCompiler
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.routing.fanout import fan_out
from pdcluster.routing.handoff import max_new_tokens

logger = logging.getLogger(__name__)

IMAGE_FETCH_TIMEOUT_S = 10.0


class Serving:
    """One gateway replica's request building, shared by its endpoints; `runner` runs the
    requests."""

    def __init__(
        self,
        cluster: ClusterClient,
        settings: GatewaySettings,
        model_name: str,
        max_model_len: int,
        metrics: GatewayMetrics,
    ) -> None:
        self.cluster = cluster
        self.settings = settings
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.runner = GroupRunner(cluster, metrics, settings.stream_interval)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.cluster.tokenizer

    async def parse(self, request: Request, model: type[BodyT]) -> BodyT:
        """The body as `model`, for this server's model or one of its LoRA adapters (another
        model id is a 404)."""
        parsed = await parse_body(request, model, self.settings.max_body_bytes)
        self.lora_for(getattr(parsed, "model", None))
        return parsed

    def lora_for(self, model_id: str | None) -> LoRARequest | None:
        """The LoRA adapter a body's `model` names (None: the base model); 404 for a model
        id this server does not serve."""
        if model_id is None or model_id == self.model_name:
            return None
        lora = self.cluster.adapters.get(model_id)
        if lora is None:
            raise APIError(404, self.no_such_model(model_id), "model_not_found", "model")
        return lora

    def model_of(self, request: EngineRequest) -> str:
        """The model id a request was served as: its LoRA adapter's, else the base model's."""
        lora = request.lora_request
        return self.model_name if lora is None else lora.name

    def no_such_model(self, model_id: str) -> str:
        adapters = sorted(self.cluster.adapters)
        also = f" and the LoRA adapters {adapters}" if adapters else ""
        return f"model {model_id!r} does not exist; this server serves {self.model_name!r}{also}"

    # ---- request building ------------------------------------------------------------
    def request_id(self, http: Request, body: CompletionRequest | ChatCompletionRequest) -> str:
        """The request's name in its response id and log lines: the X-Request-Id header,
        else the body's request_id, else a fresh one (vLLM's order)."""
        rid = http.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
        http.state.request_id = rid  # named in the log line of a refusal
        return rid

    def log_received(
        self, rid: str, body: CompletionRequest | ChatCompletionRequest, groups: list[Group]
    ) -> None:
        """One line per request, and one warning naming the fields it sent that do nothing."""
        num_tokens = [g.requests[0].num_prompt_tokens for g in groups]
        seqs = sum(len(g.requests) for g in groups)
        logger.info(
            "%s: %d prompt(s) of %s tokens, %d sequence(s)", rid, len(groups), num_tokens, seqs
        )
        ignored = body.ignored_fields()
        if ignored:
            logger.warning("%s: ignored fields: %s", rid, ", ".join(ignored))

    def sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        params = body.sampling_params(max_tokens, logprobs)
        truncate = body.prompt_truncation(self.max_model_len)
        if truncate is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate)
        vocab_size = self.tokenizer.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise APIError(
                    400,
                    f"{name}: {outside[0]} is not a token id of this model "
                    f"(vocabulary of {vocab_size})",
                    "invalid_value",
                    name,
                )
        return params

    @cached_property
    def _grammars(self) -> GrammarCompiler:
        return GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size)

    async def check_grammar(self, params: SamplingParams, asked_by: str | None) -> None:
        """Compile the grammar the field `asked_by` asks for (off the event loop: a large
        schema takes milliseconds), so that a bad one is the client's 400, not a failed
        request."""
        structured = params.structured_outputs
        if structured is None:
            return
        try:
            await asyncio.to_thread(self._grammars.matcher, structured)
        except ValueError as exc:
            raise APIError(400, f"{asked_by}: {exc}", "invalid_value", asked_by) from None

    def fits(self, text: str) -> str:
        """Refuse, before tokenizing it (which holds the event loop), a text too long to
        fit the context whatever its tokens: each token spells at most max_token_chars
        characters (twice that allows for normalizers that shorten text)."""
        if len(text) > 2 * self.max_model_len * self.tokenizer.max_token_chars:
            raise ValueError(
                f"prompt has {len(text)} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold"
            )
        return text

    def make(
        self,
        prompt: Any,
        params: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
    ) -> EngineRequest:
        """The engine request for one prompt of `body` (its cache salt and priority too),
        named after the HTTP request `rid` (and unique however often a client reuses its
        request_id)."""
        if body.priority and not self.cluster.priority_scheduling:
            raise APIError(
                400,
                f"priority: got {body.priority}, but this server schedules first come, first "
                "served; a priority needs the engine's scheduling_policy 'priority'",
                "invalid_value",
                "priority",
            )
        if isinstance(prompt, str):
            self.fits(prompt)
        request = self.cluster.make_request(
            prompt, params, f"{rid}-{uuid.uuid4().hex[:8]}", body.cache_salt, body.priority,
            self.lora_for(body.model),
        )  # fmt: skip
        room = self.max_model_len - request.num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; this model's maximum context length is {self.max_model_len} tokens"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {request.num_prompt_tokens} and max_tokens asks for {params.max_tokens} more"
            )
        return request

    def group(
        self, prompt_index: int, request: EngineRequest, num_seqs: int, asked_by: str
    ) -> Group:
        """The prompt's `num_seqs` sequences. Planned onto one instance together, they must
        all fit its KV cache at once (`asked_by`: the body field that asked for them)."""
        max_new = max_new_tokens(request, self.max_model_len)
        capacity = self.cluster.kv_tokens_per_instance
        needed = num_seqs * (request.num_prompt_tokens + max_new)
        if num_seqs > 1 and capacity is not None and needed > capacity:
            raise APIError(
                400,
                f"{asked_by}: {num_seqs} sequences of {request.num_prompt_tokens} prompt tokens and "
                f"up to {max_new} new tokens each exceed the {capacity} tokens of KV cache one "
                f"instance holds; lower {asked_by} or max_tokens",
                "invalid_value",
                asked_by,
            )
        first = prompt_index * num_seqs
        results = [
            Result(first + i, prompt_index, request.num_prompt_tokens) for i in range(num_seqs)
        ]
        return Group(fan_out(request, num_seqs), results)

    async def fetch_image(self, url: str) -> Any:
        """A data: URL, or an http(s) URL whose host the config allow-lists (no other
        server-side fetch is ever made)."""
        if url.startswith("data:"):
            data = decode_data_url(url, self.settings.max_body_bytes)
            return await asyncio.to_thread(load_image, data)  # decoding can take a while
        parsed = urlparse(url)
        allowed = self.settings.allowed_image_hosts
        if parsed.scheme not in ("http", "https") or parsed.hostname not in allowed:
            raise ValueError(
                "image_url must be a data: URL; remote URLs are refused unless their host is "
                "allow-listed"
            )
        data = await asyncio.to_thread(_download, url, self.settings.max_body_bytes)
        return await asyncio.to_thread(load_image, data)

    # ---- chat templates and tools ----------------------------------------------------
    @cached_property
    def renderer(self) -> ChatRenderer:
        settings = self.settings
        return ChatRenderer(
            self.tokenizer, settings.chat_template, settings.chat_template_content_format
        )

    @cached_property
    def tool_parser(self) -> ToolParser | None:
        """The parser of "auto" tool calls; None unless auto tool choice is enabled."""
        name = self.settings.tool_call_parser
        return tool_parser(name) if self.settings.enable_auto_tool_choice and name else None

    # ---- token texts -----------------------------------------------------------------
    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """A logprob entry's token: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def alternatives(self, top: TopLogprobs, as_ids: bool = False) -> list[tuple[str, float]]:
        return [(self.token_text(t, as_ids), lp) for t, lp in zip(top.token_ids, top.logprobs)]


def _download(url: str, max_bytes: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=IMAGE_FETCH_TIMEOUT_S) as response:  # noqa: S310
            data = response.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"could not fetch image {url}: {exc}") from None
    if len(data) > max_bytes:
        raise ValueError(f"image at {url} exceeds {max_bytes} bytes")
    return data
