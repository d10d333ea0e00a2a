"""Deployment artefacts: KubeRay manifests, cluster-launcher config, Grafana dashboard.

No Ray, no network. Each manifest under deploy/ must validate against KubeRay's CRD schema
(what `kubectl apply` checks), name code that exists, and pin every role of
ray_configs/kuberay-1e1p1d.yaml to a worker group that declares the role's resources. The
groups autoscale: they start at the config's counts and grow to maxReplicas when instances
are added at run time.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pdcluster.actors.messages import InstanceStats, SchedulerStats
from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.cluster.config import ClusterConfig
from pdcluster.connectors.stats import KVTransferStats, LatencyHistogram

REPO = Path(__file__).resolve().parents[1]
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
DEPLOY = REPO / "deploy"
CONFIG = REPO / "ray_configs" / "kuberay-1e1p1d.yaml"
LAUNCHER = REPO / "ray_configs" / "cluster-launcher.yaml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
IMAGE_PROJECT_DIR = "/home/ray/pdcluster"  # deploy/Dockerfile's WORKDIR: the repo root in pods
SERVE_IMPORT_PATH = "pdcluster.cluster.serve_app:build_app"
JOB_MODULE = "pdcluster.cluster.job"
MANIFESTS = {
    "raycluster.yaml": "RayCluster",
    "rayservice.yaml": "RayService",
    "rayjob.yaml": "RayJob",
}
# RayService fields that KubeRay v1 still accepts but ignores.
DEPRECATED_FIELDS = ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold")
ROLE_RESOURCE = {
    "encoder": "pdcluster_encoder",
    "prefill": "pdcluster_prefill",
    "decode": "pdcluster_decode",
}
GPU_ROLES = ("prefill", "decode")
GATEWAY_RESOURCE = "pdcluster_gateway"  # each gateway replica's ask: never on the head

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "pdcluster_kv_transfer_latency_seconds",
}
COUNTERS = {
    "vllm:request_success_total",  # {model_name, finished_reason}
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "pdcluster_http_requests_total",  # {endpoint, method, status}
    "pdcluster_kv_transfer_bytes_total",
    "pdcluster_ec_transfer_bytes_total",
    "pdcluster_kv_leases_expired_total",
    "pdcluster_planner_decisions_total",  # {role, direction}: instances added or drained
    "pdcluster_request_migrations_total",  # streams moved off a lost instance
}
GAUGES = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "pdcluster_instance_healthy",
    "pdcluster_num_deferred",
    "pdcluster_num_pending_transfers",
    "pdcluster_instances",  # {role}: live instances
    "pdcluster_instances_desired",  # {role}: the planner's target (live count without one)
}
GATEWAY_METRICS = HISTOGRAMS | COUNTERS | GAUGES
METRIC_NAME = re.compile(r"\b(?:pdcluster_\w+|vllm:\w+)")


# ---- helpers -----------------------------------------------------------------------------
def load_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 1 MB each
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)


def structural_to_jsonschema(node: Any) -> Any:
    """A Kubernetes structural schema as plain JSON Schema.

    `x-kubernetes-*` keys are annotations, except: int-or-string accepts either type, and
    preserve-unknown-fields accepts any field. Elsewhere unknown fields are rejected, as
    `kubectl apply` does (strict field validation); `nullable` also accepts null.
    """
    if isinstance(node, list):
        return [structural_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    int_or_string = bool(node.get("x-kubernetes-int-or-string"))
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    out: dict[str, Any] = {}
    if int_or_string:  # keeps e.g. a quantity's `pattern`, which applies to strings only
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if int_or_string and key in ("anyOf", "type"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: structural_to_jsonschema(sub) for name, sub in value.items()}
        else:
            out[key] = structural_to_jsonschema(value)
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(kind: str) -> dict:
    """The v1 schema of a KubeRay kind, from ray.io_<kind>s.yaml (e.g. ray.io_rayjobs.yaml)."""
    crd = load_yaml(CRD_DIR / f"ray.io_{kind.lower()}s.yaml")
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return structural_to_jsonschema(version["schema"]["openAPIV3Schema"])


def manifest(name: str) -> dict:
    return load_yaml(DEPLOY / name)


def cluster_spec(doc: dict) -> dict:
    """The RayCluster spec of a RayCluster, RayService or RayJob."""
    key = {"RayCluster": None, "RayService": "rayClusterConfig", "RayJob": "rayClusterSpec"}
    return doc["spec"] if key[doc["kind"]] is None else doc["spec"][key[doc["kind"]]]


def parse_ray_resources(value: str) -> dict[str, float]:
    """rayStartParams.resources: JSON, shell-quoted (KubeRay splices it into `ray start`)."""
    (unquoted,) = shlex.split(value)
    return {k: float(v) for k, v in json.loads(unquoted).items()}


def quantity(value: Any) -> float:
    """A Kubernetes quantity of CPUs or GPUs ("8", 8, "500m")."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def role_groups(doc: dict) -> dict[str, dict]:
    """The worker groups of a manifest's RayCluster spec that run a role, by role."""
    groups = {g["groupName"]: g for g in cluster_spec(doc)["workerGroupSpecs"]}
    return {role: groups[role] for role in ROLE_RESOURCE}


def instances_per_pod(group: dict, role: str, config: ClusterConfig) -> int:
    declared = parse_ray_resources(group["rayStartParams"]["resources"])
    return int(declared[ROLE_RESOURCE[role]] // config.role(role).resources[ROLE_RESOURCE[role]])


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def repo_path(image_path: str) -> Path:
    """A path in the image (IMAGE_PROJECT_DIR/...) or relative to it, as a repo path."""
    path = Path(image_path)
    if path.is_absolute():
        assert path.is_relative_to(IMAGE_PROJECT_DIR), f"{image_path} is outside the project"
        path = path.relative_to(IMAGE_PROJECT_DIR)
    return REPO / path


def module_file(module: str) -> Path:
    """The file an import path names, found as the Serve controller's import finds it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"no module {module}"
    return Path(spec.origin)


def defines_function(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return any(isinstance(node, kinds) and node.name == name for node in tree.body)


@pytest.fixture(scope="module")
def config() -> ClusterConfig:
    return ClusterConfig.from_yaml(CONFIG)


@pytest.fixture(scope="module", params=sorted(MANIFESTS))
def doc(request: pytest.FixtureRequest) -> dict:
    return manifest(request.param)


# ---- CRD schemas -------------------------------------------------------------------------
def test_structural_schema_conversion() -> None:
    schema = structural_to_jsonschema(
        {
            "type": "object",
            "properties": {
                "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}]},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "maybe": {"type": "string", "nullable": True},
            },
        }
    )
    validator = jsonschema.Draft7Validator(schema)
    assert validator.is_valid({"port": 8000, "free": {"a": 1}, "maybe": None})
    assert validator.is_valid({"port": "serve"})
    assert not validator.is_valid({"port": 1.5})
    assert not validator.is_valid({"prot": 8000})  # a typo is an unknown field


@pytest.mark.skipif(not CRD_DIR.is_dir(), reason=f"KubeRay CRD schemas not found at {CRD_DIR}")
@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_validates_against_crd(name: str) -> None:
    doc = manifest(name)
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == MANIFESTS[name]
    validator = jsonschema.Draft7Validator(crd_schema(doc["kind"]))
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]
    assert not errors, "\n".join(errors)


def test_crd_validation_catches_a_broken_manifest() -> None:
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {CRD_DIR}")
    doc = copy.deepcopy(manifest("raycluster.yaml"))
    doc["spec"]["workerGroupSpecs"][0]["replica"] = 1  # misspelt
    del doc["spec"]["workerGroupSpecs"][1]["maxReplicas"]
    assert not jsonschema.Draft7Validator(crd_schema("RayCluster")).is_valid(doc)


# ---- cluster shape -----------------------------------------------------------------------
def test_head_runs_no_actors_and_stays_private(doc: dict) -> None:
    head = cluster_spec(doc)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "resources" not in head["rayStartParams"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False)
    assert not any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in containers(head))


def test_the_head_can_die_gcs_fault_tolerance_on_redis(doc: dict) -> None:
    """The GCS keeps its state in Redis, and every pod's Ray waits for a restarting GCS
    longer than Ray's 60 s default (docs/deployment.md, "GCS fault tolerance")."""
    spec = cluster_spec(doc)
    options = spec["gcsFaultToleranceOptions"]
    assert options["redisAddress"] and options["redisPassword"]["valueFrom"]["secretKeyRef"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for container in (c for group in groups for c in containers(group)):
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert int(env["RAY_gcs_rpc_server_reconnect_timeout_s"]) >= 300, container["name"]


def test_worker_groups_pin_the_config_roles(doc: dict, config: ClusterConfig) -> None:
    groups = {g["groupName"]: g for g in cluster_spec(doc)["workerGroupSpecs"]}
    declared = {
        name: parse_ray_resources(g["rayStartParams"].get("resources", '"{}"'))
        for name, g in groups.items()
    }
    for role, resource in ROLE_RESOURCE.items():
        # Only the role's own group declares its resource, so nothing else lands there.
        assert [name for name, res in declared.items() if resource in res] == [role]
        spec = config.role(role)
        assert spec.count >= 1 and spec.resources == {resource: 1.0}
        group, (container,) = groups[role], containers(groups[role])
        per_pod = declared[role][resource] // spec.resources[resource]
        assert group["replicas"] * per_pod >= spec.count, f"{role}: too few pods"
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert quantity(limits["cpu"]) >= spec.num_cpus * per_pod
        gpus = quantity(limits.get("nvidia.com/gpu", 0))
        assert gpus >= spec.num_gpus * per_pod
        if role in GPU_ROLES:
            assert spec.num_gpus >= 1 and gpus >= 1
            assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"]


def gateway_slots(doc: dict) -> dict[str, float]:
    """Gateway replicas each worker group's pods hold, by group (groups that hold any)."""
    slots = {}
    for group in cluster_spec(doc)["workerGroupSpecs"]:
        declared = parse_ray_resources(group["rayStartParams"].get("resources", '"{}"'))
        if declared.get(GATEWAY_RESOURCE):
            slots[group["groupName"]] = declared[GATEWAY_RESOURCE]
    return slots


def test_gateway_replicas_go_to_worker_pods_with_spare_cpus(
    doc: dict, config: ClusterConfig
) -> None:
    # Serve's replicas and `gateway.replicas` ask for it; the head declares no resources.
    assert config.gateway.resources == {GATEWAY_RESOURCE: 1.0}
    slots = gateway_slots(doc)
    groups = {g["groupName"]: g for g in cluster_spec(doc)["workerGroupSpecs"]}
    assert sorted(slots) == sorted(GPU_ROLES), slots
    for role, num_slots in slots.items():
        group = groups[role]
        (container,) = containers(group)
        taken = config.role(role).num_cpus * instances_per_pod(group, role, config)
        spare = quantity(container["resources"]["limits"]["cpu"]) - taken
        assert spare >= num_slots, f"{role}: {num_slots} gateway replicas, {spare} spare CPUs"


def test_worker_groups_autoscale(doc: dict, config: ClusterConfig) -> None:
    spec = cluster_spec(doc)
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] > 0, "freed pods must be removed"
    assert options["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    limits = options["resources"]["limits"]
    assert quantity(limits["cpu"]) > 0 and limits["memory"]
    for role, group in role_groups(doc).items():
        # The cluster starts with the config's instances and can grow past them.
        per_pod = instances_per_pod(group, role, config)
        assert group["minReplicas"] == math.ceil(config.role(role).count / per_pod), role
        assert group["replicas"] == group["minReplicas"], role
        assert group["minReplicas"] < group["maxReplicas"], f"{role} cannot scale"


def test_rayservice_upgrades_to_a_new_cluster_without_deprecated_fields() -> None:
    spec = manifest("rayservice.yaml")["spec"]
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert spec["rayClusterDeletionDelaySeconds"] > 0  # open streams drain on the old cluster
    for name in MANIFESTS:
        text = (DEPLOY / name).read_text(encoding="utf-8")
        assert not [f for f in DEPRECATED_FIELDS if f in text], name


def test_manifests_agree(config: ClusterConfig) -> None:
    docs = [manifest(name) for name in sorted(MANIFESTS)]
    specs = [cluster_spec(d) for d in docs]
    assert len({s["rayVersion"] for s in specs}) == 1
    assert all(s["autoscalerOptions"] == specs[0]["autoscalerOptions"] for s in specs)
    bounds = [
        {role: (g["minReplicas"], g["maxReplicas"]) for role, g in role_groups(d).items()}
        for d in docs
    ]
    assert all(b == bounds[0] for b in bounds), bounds
    pods = [s["headGroupSpec"] for s in specs] + [g for s in specs for g in s["workerGroupSpecs"]]
    images = {c["image"] for pod in pods for c in containers(pod)}
    assert len(images) == 1, images
    assert {c.get("workingDir") for pod in pods for c in containers(pod)} == {IMAGE_PROJECT_DIR}
    assert config.ray.address == "auto"


def test_dockerfile_installs_the_project_where_manifests_expect_it() -> None:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(rf"^WORKDIR {re.escape(IMAGE_PROJECT_DIR)}$", text, re.M)
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M).group(1)
    assert ray_version == cluster_spec(manifest("raycluster.yaml"))["rayVersion"]
    assert re.search(r"^ARG TORCH=torch==\S+$", text, re.M), "torch must be pinned"
    assert "ray_configs/" in text and "pip install" in text


# ---- entrypoints -------------------------------------------------------------------------
def test_rayservice_serves_the_app_builder() -> None:
    doc = manifest("rayservice.yaml")
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    # The pods that never scale away hold the gateway's replicas (Serve's default: one).
    always_up = sum(
        n * g["minReplicas"]
        for name, n in gateway_slots(doc).items()
        for g in cluster_spec(doc)["workerGroupSpecs"]
        if g["groupName"] == name
    )
    assert always_up >= app["args"].get("num_replicas", 1)
    assert app["import_path"] == SERVE_IMPORT_PATH
    assert ClusterConfig.from_yaml(repo_path(app["args"]["config"])).topology_name() == "1E1P1D"
    module, attr = SERVE_IMPORT_PATH.split(":")
    path = module_file(module)
    assert path.is_file(), f"{SERVE_IMPORT_PATH}: {path.relative_to(REPO)} does not exist"
    assert defines_function(path, attr), f"{path.relative_to(REPO)} defines no {attr}()"


def test_rayservice_serve_config_matches_serves_schema() -> None:
    pytest.importorskip("ray.serve.schema")
    from ray.serve.schema import ServeDeploySchema

    from pdcluster.cluster.serve_app import GATEWAY_DEPLOYMENT

    serve_config = yaml.safe_load(manifest("rayservice.yaml")["spec"]["serveConfigV2"])
    (app,) = ServeDeploySchema.model_validate(serve_config).applications
    (gateway,) = app.deployments
    assert gateway.name == GATEWAY_DEPLOYMENT  # Serve refuses options for a missing name
    # An in-place redeploy drains open streams as long as an upgrade to a new cluster does.
    spec = manifest("rayservice.yaml")["spec"]
    assert gateway.graceful_shutdown_timeout_s == spec["rayClusterDeletionDelaySeconds"]


def test_rayjob_runs_the_batch_entrypoint() -> None:
    argv = shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", JOB_MODULE]
    assert importlib.util.find_spec(JOB_MODULE) is not None, f"no module {JOB_MODULE}"
    options = dict(zip(argv[3::2], argv[4::2]))
    assert set(options) == {"--config", "--input", "--output"}
    assert ClusterConfig.from_yaml(repo_path(options["--config"])).topology_name() == "1E1P1D"


# ---- cluster launcher --------------------------------------------------------------------
def test_cluster_launcher_node_types_pin_the_roles(config: ClusterConfig) -> None:
    launcher = load_yaml(LAUNCHER)
    node_types = launcher["available_node_types"]
    head = node_types[launcher["head_node_type"]]
    assert head["resources"].get("CPU") == 0
    for role, resource in ROLE_RESOURCE.items():
        owners = [name for name, t in node_types.items() if resource in t.get("resources", {})]
        assert owners == [role]
        resources, spec = node_types[role]["resources"], config.role(role)
        per_node = resources[resource] // spec.resources[resource]
        assert node_types[role].get("max_workers", 0) * per_node >= spec.count
        assert resources.get("GPU", 0) >= spec.num_gpus * per_node
        assert resources.get("CPU", 0) >= spec.num_cpus * per_node


def test_cluster_launcher_holds_gateway_replicas_like_the_manifests() -> None:
    node_types = load_yaml(LAUNCHER)["available_node_types"]
    slots = {
        name: t["resources"][GATEWAY_RESOURCE]
        for name, t in node_types.items()
        if GATEWAY_RESOURCE in t.get("resources", {})
    }
    assert slots == gateway_slots(manifest("raycluster.yaml"))


def test_cluster_launcher_autoscales_like_the_manifests() -> None:
    launcher = load_yaml(LAUNCHER)
    node_types = launcher["available_node_types"]
    spec = cluster_spec(manifest("raycluster.yaml"))
    for role, group in role_groups(manifest("raycluster.yaml")).items():
        node_type = node_types[role]
        assert node_type["min_workers"] < node_type["max_workers"], f"{role} cannot scale"
        assert node_type["min_workers"] == group["minReplicas"], role
        assert node_type["max_workers"] == group["maxReplicas"], role
    # The cluster-wide cap lets every node type reach its own max at once.
    assert launcher["max_workers"] == sum(t.get("max_workers", 0) for t in node_types.values())
    idle_s = launcher["idle_timeout_minutes"] * 60
    assert idle_s == spec["autoscalerOptions"]["idleTimeoutSeconds"]


def test_cluster_launcher_matches_rays_schema() -> None:
    spec = importlib.util.find_spec("ray")  # locates the package; imports nothing
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed: its cluster-launcher schema is unavailable")
    schema_path = Path(spec.submodule_search_locations[0]) / "autoscaler" / "ray-schema.json"
    if not schema_path.is_file():
        pytest.skip(f"no cluster-launcher schema at {schema_path}")
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator(schema).validate(load_yaml(LAUNCHER))


# ---- Grafana -----------------------------------------------------------------------------
def dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        query = node.get("query")
        if isinstance(query, str) and "label_values" in query:
            found.append(query)
        return found + [e for key, v in node.items() if key != "expr" for e in dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for item in node for e in dashboard_exprs(item)]
    return []


def series_metric(name: str) -> str:
    """The exported metric behind a series name (histograms add _bucket/_sum/_count)."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def test_grafana_dashboard_queries_only_gateway_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = dashboard_exprs(dashboard)
    assert exprs, "the dashboard has no queries"
    used = {series_metric(m) for e in exprs for m in re.findall(METRIC_NAME, e)}
    assert used <= GATEWAY_METRICS, f"unknown metrics: {sorted(used - GATEWAY_METRICS)}"
    assert used == GATEWAY_METRICS, f"metrics without a panel: {sorted(GATEWAY_METRICS - used)}"
    for metric in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert any(f"histogram_quantile({q}," in e and f"{metric}_bucket" in e for e in exprs)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_gateway_exports_every_dashboard_metric() -> None:
    """What the gateway's registry exposes, with one instance in its snapshot, is what the
    dashboard queries (under the exposition's names: counters end in _total)."""
    metrics = GatewayMetrics("m", max_model_len=64)
    histogram = LatencyHistogram(buckets_ms=(1.0,), counts=(0,), sum_ms=0.0, count=0)
    metrics.instances.snapshot = [
        InstanceStats(
            "i0",
            "decode",
            scheduler=SchedulerStats(num_blocks_total=8),
            kv_transfer=KVTransferStats(transfer_ms_histogram=histogram),
        )
    ]
    metrics.http_requests.labels("/v1/completions", "POST", "200").inc()
    exported = set()
    for family in metrics.registry.collect():
        suffix = "_total" if family.type == "counter" else ""
        exported.add(family.name + suffix)
    assert exported >= GATEWAY_METRICS, sorted(GATEWAY_METRICS - exported)


def test_grafana_dashboard_shows_instances_against_the_planner() -> None:
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]}
    exprs = dashboard_exprs(panels["Instances per role: desired vs actual"])
    for metric in ("pdcluster_instances", "pdcluster_instances_desired"):
        assert any(re.search(rf"by \(role\) \({metric}\{{", e) for e in exprs), metric
    (decisions,) = dashboard_exprs(panels["Planner decisions"])
    assert "by (role, direction)" in decisions
    assert "rate(pdcluster_planner_decisions_total{" in decisions
