"""Run the gateway over a cluster (`pdcluster serve`): this process is replica 0; with
`gateway.replicas` > 1 the others are Ray actors sharing its address (cluster/replicas.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import select
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

from pdcluster.actors.ray_runtime import kill_quietly
from pdcluster.cluster.api.errors import RETRY_AFTER_S
from pdcluster.cluster.client import Cluster
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.control.launch import launch
from pdcluster.cluster.replicas import (
    GRACEFUL_SHUTDOWN_S,
    gateway_app,
    listen,
    serve_on_front,
    start_replicas,
    uvicorn_server,
)
from pdcluster.engine.kv_budget import GiB

logger = logging.getLogger(__name__)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_on_sigterm() -> None:
    """SIGTERM (what systemd and Kubernetes send) stops this process like Ctrl-C, so the
    cluster is shut down on the way out. uvicorn handles SIGTERM while it runs and raises it
    again once stopped; this handler then turns it into KeyboardInterrupt. `ray.init`
    installs its own handler (sys.exit), so this is installed again after it."""
    signal.signal(signal.SIGTERM, _interrupt)


def serve(config: ClusterConfig) -> None:
    """Start the cluster and serve the OpenAI API until Ctrl-C or SIGTERM; then shut down.

    The listen port is bound before anything starts, so a port in use fails at once."""
    settings = config.gateway
    with listen(settings.host, settings.port, reuse_port=settings.replicas > 1) as sock:
        host, port = sock.getsockname()[:2]
        logger.info("starting %s with model %s", config.topology_name(), config.model or "default")
        cluster = None
        replicas: list = []  # the other gateway replicas' actors
        try:
            stop_on_sigterm()
            with answering_starting(sock):
                cluster = launch(config)
            stop_on_sigterm()
            _log_instances(cluster)
            replicas = start_replicas(config, cluster.pool, host, port, settings.replicas - 1)
            replicas_word = "replica" if settings.replicas == 1 else "replicas"
            logger.info(
                "serving %r on http://%s:%d/v1 (%d gateway %s)",
                cluster.model_name, host, port, settings.replicas, replicas_word,
            )  # fmt: skip
            _serve_until_interrupted(cluster, sock)
        except KeyboardInterrupt:
            logger.info("stopping")
        finally:
            for replica in replicas:
                kill_quietly(replica)
            if cluster is not None:
                cluster.shutdown()
                logger.info("stopped")


STARTING_BODY = json.dumps({
    "status": "starting",
    "error": {"message": "the server is starting; retry shortly", "type": "service_unavailable",
              "param": None, "code": "starting"},
}).encode()  # fmt: skip


@contextlib.contextmanager
def answering_starting(sock: socket.socket) -> Iterator[None]:
    """While the cluster starts, every connection to the (already bound) port is answered at
    once with 503 and Retry-After, /health included, instead of waiting in the backlog."""
    stop = threading.Event()
    sock.setblocking(False)  # as the server that takes over sets it
    thread = threading.Thread(target=_answer_starting, args=(sock, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _answer_starting(sock: socket.socket, stop: threading.Event) -> None:
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"retry-after: {RETRY_AFTER_S}\r\ncontent-length: {len(STARTING_BODY)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    while not stop.is_set():
        if not select.select([sock], [], [], 0.1)[0]:
            continue
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            continue  # another replica's process took it
        with conn, contextlib.suppress(OSError):
            conn.settimeout(2.0)
            received = b""
            while b"\r\n\r\n" not in received and len(received) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                received += chunk
            conn.sendall(head + STARTING_BODY)


def _serve_until_interrupted(cluster: Cluster, sock: socket.socket) -> None:
    """Serve the gateway from the Front's event loop (this thread only waits) until Ctrl-C
    or SIGTERM, then let it finish its open responses for a few seconds."""
    server = uvicorn_server(gateway_app(cluster))
    served = serve_on_front(server, cluster, sock)
    try:
        served.result()
    except KeyboardInterrupt:
        server.should_exit = True
        with contextlib.suppress(concurrent.futures.TimeoutError):
            served.result(timeout=GRACEFUL_SHUTDOWN_S + 1)
        raise


def _log_instances(cluster: Cluster) -> None:
    for stats in cluster.stats():
        role = stats.role
        size = cluster.config.engine_settings(role).block_size
        blocks = stats.scheduler.num_blocks_total
        logger.info(
            "instance %s (%s) ready: KV cache %d blocks x %d tokens = %d tokens, %.3f GiB",
            stats.instance_id,
            role,
            blocks,
            size,
            blocks * size,
            stats.kv_cache_bytes / GiB,
        )
