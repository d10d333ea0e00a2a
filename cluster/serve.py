"""Run the gateway over a cluster: in this process with uvicorn (`pdcluster serve`)."""

from __future__ import annotations

import errno
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from cluster.config import ClusterConfig
from cluster.gateway import create_app
from cluster.launch import Cluster, launch

logger = logging.getLogger(__name__)


def gateway_app(cluster: Cluster) -> FastAPI:
    return create_app(cluster, cluster.config.gateway, cluster.model_name, cluster.max_model_len)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a port in use is one clear ValueError."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


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
    with listen(settings.host, settings.port) as sock:
        host, port = sock.getsockname()[:2]
        logger.info("starting %s with model %s", config.topology_name(), config.model or "default")
        cluster = None
        try:
            stop_on_sigterm()
            cluster = launch(config)
            stop_on_sigterm()
            _log_instances(cluster)
            logger.info("serving %r on http://%s:%d/v1", cluster.model_name, host, port)
            server = uvicorn.Server(uvicorn.Config(gateway_app(cluster), log_level="info"))
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            logger.info("stopping")
        finally:
            if cluster is not None:
                cluster.shutdown()
                logger.info("stopped")


def _log_instances(cluster: Cluster) -> None:
    for stats in cluster.stats():
        role = stats["role"]
        size = cluster.config.engine_settings(role).block_size
        blocks = stats.get("num_blocks_total", 0)
        logger.info(
            "instance %s (%s) ready: KV cache %d blocks x %d tokens = %d tokens",
            stats.get("id"),
            role,
            blocks,
            size,
            blocks * size,
        )
