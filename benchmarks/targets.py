"""What a benchmark runs against: a gateway URL, or a topology launched in this process.

A launched topology runs on embedded Ray (or the Ray this process already initialised) with
its gateway served by uvicorn on a free 127.0.0.1 port in a background thread; it is shut
down before the next one starts.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

if TYPE_CHECKING:
    from pdcluster.cluster.client import Cluster

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "ray_configs"


@dataclass
class Target:
    name: str  # topology name (e.g. local-1p1d) or the URL
    url: str  # gateway base URL
    model: str  # served model id
    max_model_len: int
    topology: str | None = None  # e.g. 1P1D, when known
    config_path: str | None = None
    cluster: Cluster | None = None  # a launched topology's client (Python API access)
    api_key: str | None = None


def resolve_config(name: str) -> Path:
    """A topology name (ray_configs/<name>.yaml) or a path to a config file."""
    path = Path(name)
    if path.is_file():
        return path
    candidate = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("local-*.yaml"))
    raise FileNotFoundError(f"no topology {name!r}: not a file, nor one of {known}")


def url_target(url: str, api_key: str | None = None) -> Target:
    """An already-running gateway; the model id and context length come from /v1/models."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot read {url}/v1/models: {exc}") from None
    card = response.json()["data"][0]
    return Target(url, url, card["id"], int(card.get("max_model_len") or 2048), api_key=api_key)


@dataclass(frozen=True)
class Variant:
    """A topology to launch, with config settings changed (e.g. one point of a sweep)."""

    config_name: str  # ray_configs name or YAML path
    settings: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    label: str | None = None  # the name to show instead of the config and its settings

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        changed = ",".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.config_name}[{changed}]" if changed else self.config_name

    def overrides(self) -> dict[str, Any]:
        """The settings as a nested mapping for `ClusterConfig.load`."""
        out: dict[str, Any] = {}
        for key, value in self.settings.items():
            *parents, leaf = key.split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return out


def expand_variants(config_names: list[str], varies: list[str]) -> list[Variant]:
    """Each topology, or one variant per combination of the values its `--vary` specs
    (`TOPOLOGY:KEY=V1,V2,...`, KEY dotted as in the YAML, values parsed as YAML scalars)
    give it, in the order given."""
    values: dict[str, dict[str, list[Any]]] = {name: {} for name in config_names}
    for spec in varies:
        topology, _, assignment = spec.partition(":")
        key, _, listed = assignment.partition("=")
        if topology not in values:
            raise ValueError(f"--vary {spec!r}: {topology!r} is not one of --topologies")
        if not key or not listed:
            raise ValueError(f"--vary {spec!r}: expected TOPOLOGY:KEY=V1,V2,...")
        values[topology][key] = [yaml.safe_load(v) for v in listed.split(",")]
    variants = []
    for name, keyed in values.items():
        for combo in itertools.product(*keyed.values()):
            variants.append(Variant(name, dict(zip(keyed, combo))))
    return variants


def load_variant(variant: Variant, model: str | None) -> Any:
    """The variant's validated `ClusterConfig` (model overridden when given); a clear
    ValueError names a bad setting."""
    from pdcluster.cluster.config import ClusterConfig

    overrides = variant.overrides()
    if model:
        overrides["model"] = model
    return ClusterConfig.load(resolve_config(variant.config_name), overrides)


@contextlib.contextmanager
def local_target(variant: Variant, model: str | None) -> Iterator[Target]:
    """Launch the topology (model overridden when given) and serve its gateway."""
    from pdcluster.cluster.control.launch import launch
    from pdcluster.cluster.replicas import gateway_app

    path = resolve_config(variant.config_name)
    config = load_variant(variant, model)
    cluster = launch(config)
    try:
        with serve_in_thread(gateway_app(cluster)) as url:
            yield Target(
                name=variant.name,
                url=url,
                model=cluster.model_name,
                max_model_len=cluster.max_model_len,
                topology=config.topology_name(),
                config_path=str(path),
                cluster=cluster,
            )
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def shared_ray(config_names: list[str]) -> Iterator[None]:
    """One embedded Ray for topologies launched side by side, with the CPUs of them all
    (each config's `ray.num_cpus` is sized for it alone); shut down on the way out."""
    from pdcluster.cluster.config import ClusterConfig

    configs = [ClusterConfig.from_yaml(resolve_config(name)) for name in config_names]
    with embedded_ray(sum(c.ray.num_cpus or 0 for c in configs) or None):
        yield


@contextlib.contextmanager
def embedded_ray(num_cpus: int | None) -> Iterator[None]:
    """An embedded Ray with `num_cpus` for the block (the one already initialised, if any),
    shut down on the way out when started here."""
    import ray

    from pdcluster.cluster.config import RaySettings
    from pdcluster.cluster.control.launch import init_ray

    with keep_current_cluster_record():
        started = init_ray(RaySettings(num_cpus=num_cpus))
        try:
            yield
        finally:
            if started:
                ray.shutdown()


RAY_CURRENT_CLUSTER = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


@contextlib.contextmanager
def keep_current_cluster_record() -> Iterator[None]:
    """Restore Ray's record of "the current cluster" on the way out: a short-lived cluster
    started inside must not be what a later `ray.init()` finds."""
    before = RAY_CURRENT_CLUSTER.read_bytes() if RAY_CURRENT_CLUSTER.is_file() else None
    try:
        yield
    finally:
        if before is None:
            RAY_CURRENT_CLUSTER.unlink(missing_ok=True)
        else:
            RAY_CURRENT_CLUSTER.write_bytes(before)


def pd_config(args: Any, engine: dict[str, Any], **sections: Any) -> Any:
    """`args.prefills` P and `args.decodes` D of `args.model`, each instance one CPU, with
    `engine` settings and further config `sections` (e.g. router=...)."""
    from pdcluster.cluster.config import ClusterConfig

    roles = {
        "prefill": {"count": args.prefills, "num_cpus": 1},
        "decode": {"count": args.decodes, "num_cpus": 1},
    }
    return ClusterConfig.load(None, {"model": args.model, "engine": engine, **roles, **sections})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: Any, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve a FastAPI app on 127.0.0.1 until the block ends; yields the base URL."""
    import uvicorn

    from pdcluster.cluster.replicas import listen

    sock = listen("127.0.0.1", 0, reuse_port=True)  # more replicas may share the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="bench-gateway"
    )
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_quiet(target: Target, timeout_s: float = 60.0) -> bool:
    """Wait until no instance runs or queues a request (between runs, so that one rate's
    leftovers do not load the next); False on timeout."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    busy = ("num_running", "num_waiting", "num_deferred", "num_pending_transfers")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{target.url}/v1/cluster", headers=headers, timeout=10)
            instances = response.json()["instances"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False  # a gateway without /v1/cluster: nothing to wait on
        if not any(i.get(k) for i in instances for k in busy):
            return True
        time.sleep(0.1)
    return False
