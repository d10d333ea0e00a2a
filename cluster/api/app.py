"""The OpenAI-compatible REST gateway (FastAPI) in front of a running pdcluster: the app,
its routes and the cluster views; each generating endpoint lives in a module of its own.

Every client mistake is a 4xx with an OpenAI-shaped error body; a client that goes away
aborts its request on every instance that holds state for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcluster import __version__
from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.ray_runtime import GcsProbe
from pdcluster.cluster.api.admin_protocol import (
    LoadLoRAAdapterRequest,
    ScaleRequest,
    UnloadLoRAAdapterRequest,
)
from pdcluster.cluster.api.chat import Chat
from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.cluster_client import ClusterClient
from pdcluster.cluster.api.completions import Completions
from pdcluster.cluster.api.completions_protocol import CompletionRequest
from pdcluster.cluster.api.errors import APIError, log_refusal
from pdcluster.cluster.api.guard import Guard
from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.cluster.api.responses import NOT_STORED, Responses
from pdcluster.cluster.api.responses_protocol import ResponsesRequest
from pdcluster.cluster.api.serving import Serving
from pdcluster.cluster.api.tokens import detokenize, tokenize
from pdcluster.cluster.api.tokens_protocol import DetokenizeRequest, TokenizeRequest
from pdcluster.cluster.config import GatewaySettings
from pdcluster.engine.lora.adapter import LoRARequest

CLUSTER_VIEW_TIMEOUT_S = 1.0  # /v1/cluster and /metrics: an instance slower than this is
# reported unreachable (one restarting would otherwise hold every call for seconds)
COMPONENTS = "#/components/schemas/"


def create_app(
    cluster: ClusterClient, settings: GatewaySettings, model_name: str, max_model_len: int
) -> FastAPI:
    app = FastAPI(title="pdcluster", version="0.1.0")
    metrics = GatewayMetrics(model_name, max_model_len)
    gcs = GcsProbe()
    serving = Serving(cluster, settings, model_name, max_model_len, metrics)
    completions, chat = Completions(serving), Chat(serving)
    responses = Responses(chat)
    created = int(time.time())
    app.add_middleware(
        Guard, settings=settings, http_requests=metrics.http_requests, routes=app.router.routes
    )

    def model_card(lora: LoRARequest | None = None) -> dict[str, Any]:
        """The base model's card, or a LoRA adapter's (its folder as `root`, the base model
        as `parent`, as vLLM lists them)."""
        return {
            "id": model_name if lora is None else lora.name,
            "object": "model",
            "created": created,
            "owned_by": "pdcluster",
            "root": model_name if lora is None else lora.path,
            "parent": None if lora is None else model_name,
            "max_model_len": max_model_len,
        }

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        log_refusal(request.scope, exc)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and methods get OpenAI-shaped errors too."""
        error = APIError(exc.status_code, str(exc.detail))
        log_refusal(request.scope, error)
        response = error.response()
        response.headers.update(exc.headers or {})
        return response

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions_route(request: Request) -> Response:
        return await completions(request)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_route(request: Request) -> Response:
        return await chat(request)

    @app.post("/v1/responses", openapi_extra=_request_body(ResponsesRequest))
    async def responses_route(request: Request) -> Response:
        return await responses(request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, NOT_STORED, "response_not_found", "response_id")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = sorted(cluster.adapters.values(), key=lambda lora: lora.name)
        return {"object": "list", "data": [model_card(), *map(model_card, adapters)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return model_card(serving.lora_for(model_id))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await serving.parse(request, LoadLoRAAdapterRequest)
        if body.load_inplace:
            raise APIError(400, "load_inplace: replacing a loaded adapter is not supported; "
                           "unload it first", "invalid_value", "load_inplace")  # fmt: skip
        try:
            await cluster.load_lora_adapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value", "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await serving.parse(request, UnloadLoRAAdapterRequest)
        try:
            await cluster.unload_lora_adapter(body.lora_name)
        except LookupError:
            message = f"The lora adapter '{body.lora_name}' cannot be found."
            raise APIError(404, message, "model_not_found", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", openapi_extra=_request_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return tokenize(serving, await serving.parse(request, TokenizeRequest))

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return detokenize(serving, await serving.parse(request, DetokenizeRequest))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/cluster")
    async def cluster_view() -> dict[str, Any]:
        stats = await cluster.stats_async(CLUSTER_VIEW_TIMEOUT_S)
        kv_pool = await cluster.kv_pool_stats(CLUSTER_VIEW_TIMEOUT_S)
        return {
            "instances": [_instance_view(s) for s in stats],
            "kv_pool": None if kv_pool is None else kv_pool.to_dict(),
            # Ray's GCS: while it is down, streams and new requests go on (docs/deployment.md)
            "gcs": {"reachable": await gcs.reachable(CLUSTER_VIEW_TIMEOUT_S)},
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            stats = await asyncio.wait_for(cluster.stats_async(), 5.0)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return JSONResponse({"status": "unhealthy", "reason": str(exc)}, status_code=503)
        missing = cluster.serving_roles - {s.role for s in stats if s.healthy}
        if missing:
            roles = ", ".join(sorted(r.value for r in missing))
            reason = f"no healthy instance of role {roles}"
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/v1/admin/scale")
    async def scale(request: Request) -> dict[str, Any]:
        body = await serving.parse(request, ScaleRequest)
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
            metrics.instances.num_moves = cluster.num_moves
            metrics.instances.snapshot = await cluster.stats_async(CLUSTER_VIEW_TIMEOUT_S)
            metrics.instances.planner = await asyncio.wait_for(cluster.planner_state(), 5.0)
            metrics.instances.kv_pool = await cluster.kv_pool_stats(CLUSTER_VIEW_TIMEOUT_S)
            metrics.instances.gcs_reachable = await gcs.reachable(CLUSTER_VIEW_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - serve the request metrics even then
            metrics.instances.snapshot = []
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _document_bodies(
        app,
        (
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
        ),
    )
    return app


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


def _instance_view(s: InstanceStats) -> dict[str, Any]:
    """One instance in /v1/cluster (JSON leaves the process here)."""
    sched = s.scheduler
    view = {
        "id": s.instance_id,
        "role": s.role,
        "healthy": s.healthy,
        "reachable": s.reachable,
        "num_blocks_total": sched.num_blocks_total,
        "num_blocks_free": sched.num_blocks_free,
        "num_running": sched.num_running,
        "num_waiting": sched.num_waiting,
        "num_deferred": sched.num_deferred,
        "num_pending_transfers": s.num_pending_transfers,
        "num_pulls": s.num_pulls,
        "num_streams": s.num_streams,
        "epoch": s.epoch,
        "transfer_checks": {  # what the checked handoff refused (DESIGN.md, "Data plane")
            "kv_checksum_failures": s.kv_transfer.checksum_failures + s.kv_pool.checksum_failures,
            "ec_checksum_failures": s.ec.checksum_failures,
            "kv_acks_refused": s.kv_transfer.acks_refused,
        },
    }
    if s.sim is not None:  # a simulated engine's
        view |= {
            "sim_steps": s.sim.steps,
            "sim_steps_overrun": s.sim.steps_overrun,
            "sim_time_scale": s.sim.time_scale,
        }
    if s.spec_decode is not None:  # an engine that speculates
        view["spec_decode"] = dataclasses.asdict(s.spec_decode)
    return view
