"""Ray Serve application: the same gateway, for a KubeRay RayService.

`serveConfigV2` names `import_path: pdcluster.cluster.serve_app:build_app` with `args: {config: ...}`.
Every replica of the gateway deployment attaches to ONE instance pool (named by `pool`):
the first replica to start launches it (detached, so it outlives replicas that come and go),
the others attach; each replica plans its own requests and reads tokens straight from the
instances. So `num_replicas` > 1 and Serve autoscaling work. Each replica asks Ray for the
config's `gateway.num_cpus` and `gateway.resources` (e.g. `{pdcluster_gateway: 1}`, which
only worker pods declare), so none lands on a KubeRay head started with num-cpus 0.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from pdcluster.cluster.config import ClusterConfig

DEFAULT_CONFIG = "local-1e1p1d"  # a built-in topology (see cluster.config_yaml.config_path)
DEFAULT_POOL = "pdcluster-serve"
GATEWAY_DEPLOYMENT = "pdcluster-gateway"  # serveConfigV2 `deployments:` entries name it
BUILD_ARGS = ("config", "model", "pool", "num_replicas", "autoscaling_config")


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve app builder. `args`: `config` (a topology YAML path, a built-in topology's name,
    or the config itself as a mapping; default the local 1E1P1D), optionally `model` (overrides the config's model),
    `pool` (the instance pool's name, default "pdcluster-serve"), and the gateway
    deployment's `num_replicas` or `autoscaling_config`."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(BUILD_ARGS))
    if unknown:
        raise ValueError(f"unknown build_app args: {unknown} (expected {', '.join(BUILD_ARGS)})")
    overrides = {"model": args["model"]} if "model" in args else {}
    source = args.get("config", DEFAULT_CONFIG)
    if isinstance(source, dict):
        config = ClusterConfig.model_validate({**source, **overrides})
    else:
        config = ClusterConfig.load(source, overrides)
    pool = args.get("pool", DEFAULT_POOL)

    def build_gateway():
        from pdcluster.cluster.control.launch import launch
        from pdcluster.cluster.replicas import gateway_app

        return gateway_app(launch(config, pool=pool, detached=True))

    options: dict[str, Any] = {}
    for key in ("num_replicas", "autoscaling_config"):
        if key in args:
            options[key] = args[key]
    ingress = serve.ingress(build_gateway)()
    deployment = serve.deployment(
        ingress,
        name=GATEWAY_DEPLOYMENT,
        ray_actor_options=config.gateway.ray_actor_options(),
        max_ongoing_requests=1024,
        **options,
    )
    return deployment.bind()
