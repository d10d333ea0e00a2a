"""Gateway replicas: N processes serving the OpenAI API on one address.

Each replica binds the same host:port with SO_REUSEPORT, so the kernel spreads incoming
connections over them, and each attaches to the one instance pool with a client of its own
(it plans its own requests and reads its tokens straight from the instances). The serving
process is replica 0; the others are Ray actors on one Ray node of its host (they must share
its network), asking for `gateway.num_cpus` and `gateway.resources` like Serve replicas do.
Each serves HTTP on its Front's event loop (`serve_on_front`), so a stream's outputs reach its
response with no hop between threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import socket
from typing import Any

import ray
import uvicorn
from fastapi import FastAPI
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdcluster.cluster.api.app import create_app
from pdcluster.cluster.client import Cluster
from pdcluster.cluster.config import ClusterConfig, GatewaySettings
from pdcluster.cluster.control.launch import launch


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
    """Wrap with `ray.remote(GatewayReplica)`: one more replica of a running gateway."""

    def __init__(self, config: dict[str, Any], pool: str, host: str, port: int) -> None:
        self.cluster = launch(ClusterConfig.model_validate(config), pool=pool)
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


def replica_node(settings: GatewaySettings, count: int) -> str:
    """The Ray node for `count` more replicas: one on this process's host (the replicas share
    its listen address) whose resources hold them all, this process's own node first. A
    ValueError says what to change when no node on the host does (e.g. `pdcluster serve` run
    on a KubeRay head while `gateway.resources` names a resource only workers declare)."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    host = next(n["NodeManagerAddress"] for n in nodes if n["NodeID"] == here)
    ask = {"CPU": settings.num_cpus, **settings.resources}
    fits = [
        n["NodeID"]
        for n in sorted(nodes, key=lambda n: n["NodeID"] != here)
        if n["NodeManagerAddress"] == host
        and all(n["Resources"].get(name, 0) >= amount * count for name, amount in ask.items())
    ]
    if not fits:
        raise ValueError(
            f"gateway.replicas: {count} more replicas need {ask} each on a Ray node of this "
            f"host ({host}), and none has that much; run `pdcluster serve` on a node that "
            "declares it, or lower gateway.replicas, gateway.num_cpus or gateway.resources"
        )
    return fits[0]


def start_replicas(
    config: ClusterConfig, pool: str, host: str, port: int, count: int
) -> list[ray.actor.ActorHandle]:
    """`count` more replicas on this host, serving once this returns."""
    if count == 0:
        return []
    node = NodeAffinitySchedulingStrategy(replica_node(config.gateway, count), soft=False)
    replicas = [
        ray.remote(GatewayReplica)
        .options(
            **config.gateway.ray_actor_options(), scheduling_strategy=node, max_concurrency=1000
        )
        .remote(config.model_dump(), pool, host, port)
        for _ in range(count)
    ]
    for replica in replicas:
        replica.serve.remote()
    return replicas
