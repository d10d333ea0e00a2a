"""The OpenAI-compatible REST gateway (FastAPI) in front of a running pdcluster.

Every client mistake is a 4xx with an OpenAI-shaped error body; a client that goes away
aborts its request on every instance that holds state for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import re
import time
import urllib.request
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.config import GatewaySettings
from cluster.metrics import GatewayMetrics
from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ScaleRequest,
    TokenizeRequest,
)
from cluster.sse import DONE, ChunkEncoder, EventStreamResponse
from cluster.tools import ToolCallParser, forced_call_schema
from engine.multimodal import decode_data_url, load_image
from engine.outputs import EngineCoreOutput, TopLogprobs
from engine.request import Request as EngineRequest
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer, chat_template_takes_content_parts, chat_template_takes_tools
from pdcluster import __version__
from routing.fanout import fan_out
from routing.handoff import max_new_tokens

BodyT = TypeVar("BodyT", bound=BaseModel)
DISCONNECT_POLL_S = 0.1
CLUSTER_VIEW_TIMEOUT_S = 1.0  # /v1/cluster and /metrics: an instance slower than this is
# reported unreachable (one restarting would otherwise hold every call for seconds)
RETRY_AFTER_S = 5  # told to clients whose request lost its instance
IMAGE_FETCH_TIMEOUT_S = 10.0
COMPONENTS = "#/components/schemas/"
# A \uXXXX escape of a UTF-16 surrogate: only through one can an ASCII body hold a lone one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Behind the API key, with every path under /v1/ (/health, /metrics and the docs stay open).
KEYED_PATHS = ("/tokenize", "/detokenize", "/version")
# The methods counted by name in pdcluster_http_requests_total (others are `other`).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class ClusterClient(Protocol):
    """What the gateway needs of a cluster (cluster.launch.Cluster provides it)."""

    tokenizer: Tokenizer

    def make_request(
        self, prompt: Any, params: SamplingParams, request_id: str
    ) -> EngineRequest: ...

    kv_tokens_per_instance: int | None

    def stream_group(
        self, requests: list[EngineRequest]
    ) -> AsyncIterator[tuple[int, EngineCoreOutput]]: ...

    async def stats_async(self, timeout_s: float = ...) -> list[dict[str, Any]]: ...

    async def scale(self, role: str, count: int) -> dict[str, str]: ...

    async def planner_state(self) -> dict[str, Any]: ...


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "internal_error"
        if self.status == 401:
            kind = "authentication_error"
        body = {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class _Result:
    """One sequence's output as it accumulates."""

    index: int  # its choice's
    prompt_index: int  # the prompt it samples: usage counts each prompt once
    num_prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when alternatives were asked
    finish_reason: str | None = None
    error: str | None = None
    unavailable: bool = False  # the error was the cluster's (see EngineCoreOutput)

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


@dataclass
class _Group:
    """The sequences sampling one prompt (n, best_of), run together (`stream_group`)."""

    requests: list[EngineRequest]
    results: list[_Result]


def create_app(
    cluster: ClusterClient, settings: GatewaySettings, model_name: str, max_model_len: int
) -> FastAPI:
    app = FastAPI(title="pdcluster", version="0.1.0")
    metrics = GatewayMetrics(model_name, max_model_len)
    gw = _Gateway(cluster, settings, model_name, max_model_len, metrics)
    app.add_middleware(
        _Guard, gateway=gw, http_requests=metrics.http_requests, routes=app.router.routes
    )

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and methods get OpenAI-shaped errors too."""
        response = APIError(exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})
        return response

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await gw.completions(request)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await gw.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [gw.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, gw.no_such_model(model_id), "model_not_found", "model")
        return gw.model_card()

    @app.post("/tokenize", openapi_extra=_request_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        return gw.tokenize(await gw.parse(request, TokenizeRequest))

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        return gw.detokenize(await gw.parse(request, DetokenizeRequest))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/cluster")
    async def cluster_view() -> dict[str, Any]:
        stats = await cluster.stats_async(CLUSTER_VIEW_TIMEOUT_S)
        return {"instances": [_instance_view(s) for s in stats]}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            stats = await asyncio.wait_for(cluster.stats_async(), 5.0)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return JSONResponse({"status": "unhealthy", "reason": str(exc)}, status_code=503)
        serving = [s for s in stats if s.get("role") != "encoder" and s.get("healthy")]
        if not serving:
            return JSONResponse(
                {"status": "unhealthy", "reason": "no healthy instance"}, status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.post("/v1/admin/scale")
    async def scale(request: Request) -> dict[str, Any]:
        body = await gw.parse(request, ScaleRequest)
        try:
            members = await cluster.scale(body.role, body.count)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - e.g. no room for new instances: retry later
            raise APIError(503, f"scaling failed: {exc}", "scale_failed") from None
        ids = sorted(i for i, role in members.items() if role == body.role)
        return {"role": body.role, "count": len(ids), "instances": ids}

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            metrics.instances.snapshot = await cluster.stats_async(CLUSTER_VIEW_TIMEOUT_S)
            metrics.instances.planner = await asyncio.wait_for(cluster.planner_state(), 5.0)
        except Exception:  # noqa: BLE001 - serve the request metrics even then
            metrics.instances.snapshot = []
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _document_bodies(
        app, (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
    )
    return app


class _Guard:
    """API key and declared body size, checked before routing; every response's status
    counted. A plain ASGI middleware: an `@app.middleware("http")` one would pass every
    request and streamed chunk through a task group and memory streams (a fraction of a
    millisecond each)."""

    def __init__(
        self, app: ASGIApp, gateway: _Gateway, http_requests: Counter, routes: list[BaseRoute]
    ) -> None:
        self.app, self.gateway = app, gateway
        self.http_requests, self.routes = http_requests, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
                labels = (self._endpoint(scope), method, str(message["status"]))
                self.http_requests.labels(*labels).inc()
            await send(message)

        try:
            self.gateway.authorize(scope)
            self.gateway.check_size(scope)
        except APIError as exc:
            await exc.response()(scope, receive, counted)
            return
        await self.app(scope, receive, counted)

    def _endpoint(self, scope: Scope) -> str:
        """The matched route's path; before routing, the request's path when a route has
        it; else `other` (so that probes of random paths add no series)."""
        route = scope.get("route")
        if route is not None:
            return route.path
        path = scope["path"]
        return path if any(getattr(r, "path", None) == path for r in self.routes) else "other"


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body the handler parses itself (so its errors stay OpenAI-shaped)."""
    ref = {"$ref": f"{COMPONENTS}{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add the request bodies' JSON schemas to the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=COMPONENTS + "{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _instance_view(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": s.get("id"),
        "role": s.get("role"),
        "healthy": bool(s.get("healthy")),
        "reachable": bool(s.get("reachable", True)),
        "num_blocks_total": s.get("num_blocks_total", 0),
        "num_blocks_free": s.get("num_blocks_free", 0),
        "num_running": s.get("num_running", 0),
        "num_waiting": s.get("num_waiting", 0),
        "num_deferred": s.get("num_deferred", 0),
        "num_pending_transfers": s.get("num_pending_sends", 0) + s.get("num_pending_recvs", 0),
    }


class _Gateway:
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
        self.metrics = metrics
        self.created = int(time.time())

    # ---- guards ----------------------------------------------------------------------
    def authorize(self, scope: Scope) -> None:
        key = self.settings.api_key
        if key is None:
            return
        request = Request(scope)
        path = request.url.path
        if not path.startswith("/v1/") and path not in KEYED_PATHS:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or invalid API key", "invalid_api_key")

    def check_size(self, scope: Scope) -> None:
        length = Headers(scope=scope).get("content-length")
        if length is not None and (
            not length.isdigit() or int(length) > self.settings.max_body_bytes
        ):
            raise APIError(
                413, f"request body exceeds {self.settings.max_body_bytes} bytes", "body_too_large"
            )

    async def read_body(self, request: Request) -> bytes:
        """The body, refused as soon as it outgrows the limit (a chunked upload has no
        Content-Length for the middleware to check)."""
        limit, size, chunks = self.settings.max_body_bytes, 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds {limit} bytes", "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(self, request: Request, model: type[BodyT]) -> BodyT:
        body = await self.read_body(request)
        try:
            data = json.loads(body, parse_constant=_reject_constant)
            # Strings reach the tokenizer: a lone surrogate (\ud800) is not text.
            if not body.isascii() or SURROGATE_ESCAPE.search(body):
                json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise APIError(400, "request body holds invalid Unicode", "invalid_json") from None
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", "invalid_json")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            # The deepest error names the culprit (a union's other branches fail shallower).
            error = max(exc.errors(), key=lambda e: len(e["loc"]))
            param = ".".join(str(p) for p in error["loc"] if not _is_type_tag(p))
            if error["type"] in ("unsupported_value", "invalid_value"):  # names its field
                raise APIError(400, error["msg"], error["type"], param or None) from None
            raise APIError(400, f"{param}: {error['msg']}", "invalid_value", param) from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply", "invalid_json") from None
        if getattr(parsed, "model", None) not in (None, self.model_name):
            raise APIError(404, self.no_such_model(parsed.model), "model_not_found", "model")
        return parsed

    def no_such_model(self, model_id: str) -> str:
        return f"model {model_id!r} does not exist; this server serves {self.model_name!r}"

    # ---- endpoints -------------------------------------------------------------------
    async def completions(self, http: Request) -> Response:
        body = await self.parse(http, CompletionRequest)
        try:
            prompts = body.prompts()
            limit = self.settings.max_batch_prompts
            if len(prompts) > limit:
                raise APIError(
                    400,
                    f"prompt: a batch holds at most {limit} prompts, this one {len(prompts)}",
                    "invalid_value",
                    "prompt",
                )
            num_seqs = body.num_seqs()
            # best_of ranks sequences by their cumulative log-probability
            logprobs = 0 if body.logprobs is None and num_seqs > body.n else body.logprobs
            asked_by = "n" if num_seqs == body.n else "best_of"
            params = self._sampling_params(body, body.max_tokens, logprobs)
            await self._check_grammar(params)
            groups = [
                self._group(j, self._make(p, params), num_seqs, asked_by)
                for j, p in enumerate(prompts)
            ]
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from None
        echoes = [self._echo(p) for p in prompts] if body.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(rid, groups, include_usage, body.logprobs, echoes)
            return EventStreamResponse(chunks)
        await self._run_to_end(http, groups)
        results = [r for g in groups for r in _best(g.results, body.n)]
        choices = [
            {
                "index": r.index,
                "text": (echoes[r.prompt_index] if echoes else "") + r.text,
                "logprobs": self._completion_logprobs(
                    r.token_ids, r.logprobs, r.top_logprobs, body.logprobs
                ),
                "finish_reason": r.finish_reason,
            }
            for r in results
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage([r for g in groups for r in g.results]),
            }
        )

    async def chat_completions(self, http: Request) -> Response:
        body = await self.parse(http, ChatCompletionRequest)
        tool_parser = self._tool_parser(body)
        try:
            text = self._fits(self._render_chat(body, tools=tool_parser is not None))
            token_ids = self.cluster.tokenizer.encode(text, add_special_tokens=False)
            images = [await self._fetch_image(url) for url in body.image_urls()]
            prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            params = self._sampling_params(body, body.max_new_tokens(), body.num_logprobs())
            forced = forced_call_schema(body)
            if forced is not None:
                structured = StructuredOutputsParams(json=json.dumps(forced))
                params = dataclasses.replace(params, structured_outputs=structured)
            await self._check_grammar(params)
            group = self._group(0, self._make(prompt, params), body.n, "n")
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._chat_chunks(rid, group, include_usage, body.logprobs, tool_parser)
            return EventStreamResponse(chunks)
        await self._run_to_end(http, [group])
        choices = []
        for r in group.results:
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish_reason = r.finish_reason
            if tool_parser is not None:
                fields, finish_reason = tool_parser.message(r.text, finish_reason)
                message.update(fields)
            logprobs = self._chat_logprobs(r.token_ids, r.logprobs, r.top_logprobs, body.logprobs)
            choices.append(
                {
                    "index": r.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(group.results),
            }
        )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdcluster",
            "max_model_len": self.max_model_len,
        }

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """The prompt's token ids as a completion (or, for messages, a chat) would send them."""
        try:
            if body.messages is not None:
                text = self._fits(self._render_chat(body, body.add_generation_prompt))
                add_special_tokens = bool(body.add_special_tokens)  # the template adds its own
            else:
                text = self._fits(body.prompt or "")
                add_special_tokens = body.add_special_tokens is not False
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from None
        tokens = self.cluster.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        tokenizer = self.cluster.tokenizer
        for token_id in body.tokens:
            if not 0 <= token_id < tokenizer.vocab_size or tokenizer.id_to_token(token_id) is None:
                raise APIError(
                    400,
                    f"tokens: {token_id} is not a token id of this model "
                    f"(vocabulary of {tokenizer.vocab_size})",
                    "invalid_value",
                    "tokens",
                )
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # ---- request building ------------------------------------------------------------
    def _sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        params = body.sampling_params(max_tokens, logprobs)
        vocab_size = self.cluster.tokenizer.vocab_size
        outside = [t for t in params.logit_bias if t >= vocab_size]
        if outside:
            raise APIError(
                400,
                f"logit_bias: {outside[0]} is not a token id of this model "
                f"(vocabulary of {vocab_size})",
                "invalid_value",
                "logit_bias",
            )
        return params

    def _echo(self, prompt: str | list[int]) -> str:
        """The prompt as `echo` puts it before a completion's text."""
        if isinstance(prompt, str):
            return prompt
        return self.cluster.tokenizer.decode(prompt, skip_special_tokens=False)

    @cached_property
    def _grammars(self) -> GrammarCompiler:
        tokenizer = self.cluster.tokenizer
        return GrammarCompiler(tokenizer, tokenizer.vocab_size)

    async def _check_grammar(self, params: SamplingParams) -> None:
        """Compile the grammar `response_format` asks for (off the event loop: a large schema
        takes milliseconds), so that a bad schema is the client's 400, not a failed request."""
        structured = params.structured_outputs
        if structured is None:
            return
        try:
            await asyncio.to_thread(self._grammars.matcher, structured)
        except ValueError as exc:
            raise APIError(
                400, f"response_format: {exc}", "invalid_value", "response_format"
            ) from None

    @cached_property
    def _template_takes_content_parts(self) -> bool:
        template = self.cluster.tokenizer.chat_template
        return template is None or chat_template_takes_content_parts(template)

    @cached_property
    def _template_takes_tools(self) -> bool:
        template = self.cluster.tokenizer.chat_template
        return template is not None and chat_template_takes_tools(template)

    def _tool_parser(self, body: ChatCompletionRequest) -> ToolCallParser | None:
        """How to read calls from the output, when the request offers tools to the model."""
        if not body.calls_tools():
            return None
        if not self._template_takes_tools:
            raise APIError(
                400,
                "tools: this model's chat template does not support tools (it never renders "
                "them); send the request without tools, or serve a model whose template does",
                "unsupported_value",
                "tools",
            )
        return ToolCallParser(forced=forced_call_schema(body) is not None)

    def _render_chat(
        self,
        body: ChatCompletionRequest | TokenizeRequest,
        add_generation_prompt: bool = True,
        tools: bool = False,
    ) -> str:
        """The chat prompt (with `tools`: the request's tools rendered for the model); a
        template that fails on these messages is the client's error."""
        messages = body.template_messages(self._template_takes_content_parts)
        kwargs = {}
        if tools and isinstance(body, ChatCompletionRequest):
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools or []]
        try:
            return self.cluster.tokenizer.apply_chat_template(
                messages, add_generation_prompt, **kwargs
            )
        except TypeError as exc:  # e.g. the template adds a string to a non-string value
            raise ValueError(f"chat template failed: {exc}") from None

    def _fits(self, text: str) -> str:
        """Refuse, before tokenizing it (which holds the event loop), a text too long to
        fit the context whatever its tokens: each token spells at most max_token_chars
        characters (twice that allows for normalizers that shorten text)."""
        if len(text) > 2 * self.max_model_len * self.cluster.tokenizer.max_token_chars:
            raise ValueError(
                f"prompt has {len(text)} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold"
            )
        return text

    def _make(self, prompt: Any, params: SamplingParams) -> EngineRequest:
        if isinstance(prompt, str):
            self._fits(prompt)
        request = self.cluster.make_request(prompt, params, f"req-{uuid.uuid4().hex}")
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

    def _group(
        self, prompt_index: int, request: EngineRequest, num_seqs: int, asked_by: str
    ) -> _Group:
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
            _Result(first + i, prompt_index, request.num_prompt_tokens) for i in range(num_seqs)
        ]
        return _Group(fan_out(request, num_seqs), results)

    async def _fetch_image(self, url: str) -> Any:
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

    # ---- running ---------------------------------------------------------------------
    async def _outputs(
        self, group: _Group
    ) -> AsyncGenerator[tuple[_Result, EngineCoreOutput], None]:
        """Drive one prompt's sequences, accumulating their results and recording their
        metrics (also when the client goes away: closing or cancelling this aborts the
        unfinished ones and counts them as aborted)."""
        timers = [self.metrics.start(r.num_prompt_tokens) for r in group.requests]
        try:
            async with contextlib.aclosing(self.cluster.stream_group(group.requests)) as outputs:
                async for i, out in outputs:
                    result = group.results[i]
                    timers[i].observe(out)
                    result.text += out.new_text
                    result.token_ids += out.new_token_ids
                    result.logprobs += out.new_logprobs or []
                    result.top_logprobs += out.new_top_logprobs or []
                    if out.finished:
                        result.finish_reason, result.error = out.finish_reason, out.error
                        result.unavailable = out.unavailable
                    yield result, out
        finally:
            for timer, result in zip(timers, group.results):
                timer.finish(result.finish_reason)

    async def _run_to_end(self, http: Request, groups: list[_Group]) -> None:
        """Non-streaming: every sequence at once, into its result. A client that disconnects,
        or a sequence that fails, aborts the others."""

        async def drain() -> None:
            async with contextlib.aclosing(self._merged(groups)) as outputs:
                async for result, out in outputs:
                    if out.finish_reason == "error":
                        raise _failure(result)

        work = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(_wait_disconnect(http))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                raise APIError(499, "client closed the request", "client_closed")
        finally:
            watch.cancel()
        work.result()

    async def _merged(
        self, groups: list[_Group]
    ) -> AsyncGenerator[tuple[_Result, EngineCoreOutput], None]:
        """Outputs of several prompts' sequences as they arrive (closing this aborts all)."""
        if len(groups) == 1:  # no task and queue hop between the cluster and the client
            async with contextlib.aclosing(self._outputs(groups[0])) as outputs:
                async for item in outputs:
                    yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(group: _Group) -> None:
            async with contextlib.aclosing(self._outputs(group)) as outputs:
                async for item in outputs:
                    queue.put_nowait(item)

        tasks = [asyncio.ensure_future(pump(group)) for group in groups]
        remaining = sum(len(g.results) for g in groups)
        try:
            while remaining:
                result, out = await queue.get()
                remaining -= out.finished
                yield result, out
        finally:
            for task in tasks:
                task.cancel()

    async def _completion_chunks(
        self,
        rid: str,
        groups: list[_Group],
        include_usage: bool,
        logprobs: int | None,
        echoes: list[str] | None,
    ) -> AsyncGenerator[bytes, None]:
        sse = ChunkEncoder(rid, "text_completion", int(time.time()), self.model_name)
        results = [r for g in groups for r in g.results]
        for result in results if echoes else []:
            text = echoes[result.prompt_index]
            choice = {"index": result.index, "text": text, "logprobs": None, "finish_reason": None}
            yield sse.event([choice])
        async with contextlib.aclosing(self._merged(groups)) as outputs:
            async for result, out in outputs:
                choice = {
                    "index": result.index,
                    "text": out.new_text,
                    "logprobs": self._completion_logprobs(
                        out.new_token_ids,
                        out.new_logprobs or [],
                        out.new_top_logprobs or [],
                        logprobs,
                    ),
                    "finish_reason": out.finish_reason,
                }
                if out.finish_reason == "error":
                    choice["error"] = out.error
                yield sse.event([choice])
        if include_usage:
            yield sse.event([], _usage(results))
        yield DONE

    async def _chat_chunks(
        self,
        rid: str,
        group: _Group,
        include_usage: bool,
        logprobs: bool,
        tool_parser: ToolCallParser | None,
    ) -> AsyncGenerator[bytes, None]:
        """With a `tool_parser`, the whole output goes out in the last chunk: as content, or
        as tool calls."""
        sse = ChunkEncoder(rid, "chat.completion.chunk", int(time.time()), self.model_name)
        role = {"role": "assistant", "content": ""}
        for result in group.results:
            choice = {"index": result.index, "delta": role, "logprobs": None, "finish_reason": None}
            yield sse.event([choice])
        num_sent = [0] * len(group.results)  # tokens whose logprobs went out (held-back text waits)
        async with contextlib.aclosing(self._merged([group])) as outputs:
            async for result, out in outputs:
                if not out.finished and (not out.new_text or tool_parser is not None):
                    continue  # text held back (an incomplete character, a possible stop string)
                delta: dict[str, Any] = {"content": out.new_text} if out.new_text else {}
                finish_reason = out.finish_reason
                if tool_parser is not None:
                    delta, finish_reason = tool_parser.message(result.text, finish_reason, True)
                sent = num_sent[result.index]
                ids, lps = result.token_ids[sent:], result.logprobs[sent:]
                tops = result.top_logprobs[sent:]
                num_sent[result.index] = len(result.token_ids)
                choice = {
                    "index": result.index,
                    "delta": delta,
                    "logprobs": self._chat_logprobs(ids, lps, tops, logprobs),
                    "finish_reason": finish_reason,
                }
                if out.finish_reason == "error":
                    choice["error"] = out.error
                yield sse.event([choice])
        if include_usage:
            yield sse.event([], _usage(group.results))
        yield DONE

    # ---- logprobs --------------------------------------------------------------------
    # `tops` is empty when the request asked for no alternatives, else one per token.
    def _completion_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs],
        wanted: int | None,
    ) -> dict[str, Any] | None:
        """OpenAI's legacy shape: per token, a {token: logprob} of the likeliest `wanted`
        and the sampled one."""
        if wanted is None:
            return None
        tokens = [self._token_text(t) for t in token_ids]
        top_logprobs = []
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            entry = dict(self._alternatives(tops[i])) if tops else {}
            entry.setdefault(token, lp)
            top_logprobs.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": None,
        }

    def _chat_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs],
        wanted: bool,
    ) -> dict[str, Any] | None:
        if not wanted:
            return None
        content = []
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
            entry = _chat_entry(self._token_text(token_id), lp)
            alternatives = self._alternatives(tops[i]) if tops else []
            entry["top_logprobs"] = [_chat_entry(t, alt_lp) for t, alt_lp in alternatives]
            content.append(entry)
        return {"content": content}

    def _alternatives(self, top: TopLogprobs) -> list[tuple[str, float]]:
        return [(self._token_text(t), lp) for t, lp in zip(top.token_ids, top.logprobs)]

    def _token_text(self, token_id: int) -> str:
        return self.cluster.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _usage(results: list[_Result]) -> dict[str, int]:
    """Each prompt counted once, however many sequences sampled it; every sequence's tokens."""
    prompt = sum({r.prompt_index: r.num_prompt_tokens for r in results}.values())
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _best(results: list[_Result], n: int) -> list[_Result]:
    """The n results of one prompt with the highest cumulative log-probability (best_of),
    as choices numbered after the prompt's."""
    if len(results) == n:
        return results
    ranked = sorted(results, key=lambda r: r.cumulative_logprob, reverse=True)[:n]
    return [dataclasses.replace(r, index=r.prompt_index * n + i) for i, r in enumerate(ranked)]


def _failure(result: _Result) -> APIError:
    """A non-streamed request's error: 503 when it lost its instance (a retry may succeed)."""
    if result.unavailable:
        return APIError(
            503, result.error or "no instance could serve the request", "unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    return APIError(500, result.error or "the request failed", "request_failed")


def _download(url: str, max_bytes: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=IMAGE_FETCH_TIMEOUT_S) as response:  # noqa: S310
            data = response.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"could not fetch image {url}: {exc}") from None
    if len(data) > max_bytes:
        raise ValueError(f"image at {url} exceeds {max_bytes} bytes")
    return data


def _is_type_tag(part: str | int) -> bool:
    """Pydantic's name for a union member in an error location (`str`, `list[int]`)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
