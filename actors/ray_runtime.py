"""Starting Ray, or joining a running Ray cluster, for a process that drives a pool.

`init_ray` is the one place that calls `ray.init`: the CLI's serve, scale and job commands,
the Python API's `launch` and the benchmarks all start or join Ray through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import ray
from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

TASK_EVENTS_FLUSH_MS = 100
# How long this process (and an embedded cluster's raylet) waits for a GCS that went away
# before it exits; Ray's default is 60 s. A GCS backed by Redis comes back (KubeRay restarts
# the head) and the gateway serves from the live instances meanwhile: docs/deployment.md.
GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
GCS_RECONNECT_TIMEOUT_S = 600


def ray_is_up() -> bool:
    """Whether this process is connected to Ray already."""
    return ray.is_initialized()


def address_from_env() -> str | None:
    """RAY_ADDRESS when it names a cluster (`ray job submit` and KubeRay set it); an http(s)
    address there is the dashboard's, for the job CLI, not for ray.init."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return address if address and not address.startswith(("http://", "https://")) else None


def init_ray(
    address: str | None,
    namespace: str,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
) -> bool:
    """Connect to (or start) Ray; True when this call started it.

    Connecting to an address uses token authentication whenever a token is available
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE is unset:
    Ray itself does so only for a cluster it finds with address "auto". A cluster that
    cannot be reached, or refuses the token, raises one ConnectionError saying what to set.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(GCS_RECONNECT_ENV, str(GCS_RECONNECT_TIMEOUT_S))
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": True}
    address = address or address_from_env()
    if not address:
        ray.init(
            **kwargs,
            address="local",  # a new embedded cluster, not one `ray start` left running
            include_dashboard=False,  # never expose the dashboard from an embedded cluster
            num_cpus=num_cpus,
            object_store_memory=object_store_memory,
            # On the way out the driver flushes task events to the GCS, waiting up to 5 s
            # for one already gone (SIGTERM to the process group reaches it first): an
            # embedded cluster's events die with it anyway. Workers start at niceness 0, not
            # Ray's 15: they are the service (see actors/priority.py).
            _system_config={
                "task_events_shutdown_flush_timeout_ms": TASK_EVENTS_FLUSH_MS,
                "worker_niceness": 0,
            },
        )
        logger.info("Ray is up (embedded, %s CPUs)", ray.cluster_resources().get("CPU"))
        return True
    token_auth = _enable_token_auth_if_token_available()
    try:
        ray.init(**kwargs, address=address)
    except (ConnectionError, ray.exceptions.RayError) as exc:
        hint = (
            "the token was refused, or the cluster is down"
            if token_auth and isinstance(exc, ConnectionError)
            else "if it uses token authentication, set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, "
            "or put the token in ~/.ray/auth_token)"
        )
        reason = str(exc).split(". ")[0].rstrip(".")
        raise ConnectionError(f"cannot connect to Ray at {address}: {reason}; {hint}") from None
    logger.info("connected to Ray at %s (token auth: %s)", address, token_auth)
    return True


def _enable_token_auth_if_token_available() -> bool:
    """Ray's rule for an auto-found cluster (token auth on when RAY_AUTH_MODE is unset and a
    token exists), applied to an explicit address; True when token auth is on. Ray offers
    this rule only from a private module, so a Ray without it means no token auth."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


class GcsProbe:
    """Whether Ray's GCS answers this process, asked off the event loop, one question at a
    time: a question to a GCS that is down waits (Ray retries it until the GCS is back or the
    reconnect timeout ends), so a slow answer reads as "unreachable" and the next asks again
    only once the pending one returned."""

    def __init__(self) -> None:
        self._asking: asyncio.Future | None = None

    async def reachable(self, timeout_s: float) -> bool:
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(asyncio.to_thread(ray.util.list_named_actors))
        try:
            await asyncio.wait_for(asyncio.shield(self._asking), timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError, ConnectionError):
            return False
        return True


def shutdown_ray() -> None:
    ray.shutdown()


def gcs_address() -> str:
    """The address of the Ray cluster this process is connected to."""
    return ray.get_runtime_context().gcs_address


def kill_quietly(actor: ActorHandle) -> None:
    """End an actor for good; one that is gone already is no error."""
    with contextlib.suppress(ray.exceptions.RayError, ValueError):
        ray.kill(actor, no_restart=True)


def cluster_resources() -> dict[str, float]:
    """The Ray cluster's logical resources (CPU, GPU, custom), whether free or not."""
    return dict(ray.cluster_resources())
