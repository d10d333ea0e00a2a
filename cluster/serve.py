"""Run the gateway over a cluster: in this process with uvicorn (`pdcluster serve`)."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

from cluster.config import ClusterConfig
from cluster.gateway import create_app
from cluster.launch import Cluster, launch

logger = logging.getLogger(__name__)


def gateway_app(cluster: Cluster) -> FastAPI:
    return create_app(cluster, cluster.config.gateway, cluster.model_name, cluster.max_model_len)


def serve(config: ClusterConfig) -> None:
    """Start the cluster and serve the OpenAI API until interrupted; then shut down."""
    cluster = launch(config)
    try:
        settings = config.gateway
        logger.info(
            "serving %r on http://%s:%d/v1", cluster.model_name, settings.host, settings.port
        )
        uvicorn.run(gateway_app(cluster), host=settings.host, port=settings.port, log_level="info")
    finally:
        cluster.shutdown()
