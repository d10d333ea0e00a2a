"""Ray Serve application: the same gateway, for a KubeRay RayService.

`serveConfigV2` names `import_path: cluster.serve_app:build_app` with `args: {config: ...}`.
The gateway replica starts the pdcluster instances (actors) on the Ray cluster it runs in.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import ClusterConfig

DEFAULT_CONFIG = "local-1e1p1d"  # a built-in topology (see cluster.config.config_path)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve app builder. `args`: `config` (a topology YAML path or a built-in topology's
    name; default the local 1E1P1D), and optionally `model` (overrides the config's model)."""
    args = dict(args or {})
    overrides = {"model": args.pop("model")} if "model" in args else {}
    config = ClusterConfig.load(args.pop("config", DEFAULT_CONFIG), overrides)
    if args:
        raise ValueError(f"unknown build_app args: {sorted(args)} (expected config, model)")

    def build_gateway():
        from cluster.launch import launch
        from cluster.serve import gateway_app

        return gateway_app(launch(config))

    ingress = serve.ingress(build_gateway)()
    deployment = serve.deployment(
        ingress,
        name="pdcluster-gateway",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,
    )
    return deployment.bind()
