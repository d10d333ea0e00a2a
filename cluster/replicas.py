"""Gateway replicas: N processes serving the OpenAI API on one address.

Each replica binds the same host:port with SO_REUSEPORT, so the kernel spreads incoming
connections over them, and each attaches to the one instance pool with a client of its own
(it plans its own requests and reads its tokens straight from the instances). The serving
process is replica 0; the others are `GatewayReplica` actors on one Ray node of its host
(they must share its network), placed by actors/gateway_replicas.py. Each serves HTTP on its
Front's event loop (`serve_on_front`), so a stream's outputs reach its response with no hop
between threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from pdcluster.actors.gateway_replicas import start_replica_actors
from pdcluster.cluster.api.app import create_app
from pdcluster.cluster.client import Cluster
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.control.launch import launch

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port; a port in use is one clear ValueError. With
    `reuse_port`, other replicas (this user's processes) may listen on it too, and the
    kernel spreads new connections over all of them."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def gateway_app(cluster: Cluster) -> FastAPI:
    """The OpenAI API over `cluster` (one replica's client of the pool)."""
    return create_app(cluster, cluster.config.gateway, cluster.model_name, cluster.max_model_len)


GRACEFUL_SHUTDOWN_S = 5


def uvicorn_server(app: Any) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    )


def serve_on_front(
    server: uvicorn.Server, cluster: Cluster, sock: socket.socket
) -> concurrent.futures.Future[None]:
    """Run `server` (the cluster's gateway) on `sock` from the cluster's Front's event loop;
    the future ends with it (`server.should_exit = True` stops it)."""
    return cluster.front.run_coroutine(server.serve(sockets=[sock]))


class GatewayReplica:
    """One more replica of a running gateway: a Ray actor (see `start_replicas`)."""

    def __init__(self, config: ClusterConfig, pool: str, host: str, port: int) -> None:
        self.cluster = launch(config, pool=pool)
        self.server = uvicorn_server(gateway_app(self.cluster))
        self.sock = listen(host, port, reuse_port=True)

    async def serve(self) -> None:
        """Serve until the actor is killed."""
        await asyncio.wrap_future(serve_on_front(self.server, self.cluster, self.sock))

    async def started(self) -> bool:
        return self.server.started

    async def counts(self) -> tuple[int, int]:
        """(requests started, requests in flight) through this replica."""
        return self.cluster.front.num_started, self.cluster.front.num_in_flight()


def start_replicas(
    config: ClusterConfig, pool: str, host: str, port: int, count: int
) -> list[ActorHandle]:
    """`count` more replicas of the gateway of `pool` on this host (actors/gateway_replicas.py
    places them), serving on host:port once this returns."""
    return start_replica_actors(GatewayReplica, (config, pool, host, port), config.gateway, count)
