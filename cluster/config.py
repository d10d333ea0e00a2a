"""Cluster configuration: pydantic at the boundary, converted to frozen dataclasses inside.

A topology is counts and resources per role (encoder, prefill, decode, mixed) around one
model. Loaded from YAML (a path, or the name of a built-in topology in ray_configs/), from
overrides (the CLI's flags) on top of one, or built in Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pdcluster.cluster.api.tool_parsers import PARSERS
from pdcluster.cluster.autoscale_config import AUTOSCALED_ROLES, AutoscaleSettings
from pdcluster.cluster.config_yaml import (
    StrictSection,
    config_path,
    describe_errors,
    merge,
    read_yaml,
)
from pdcluster.cluster.lora_config import LoRASettings, check_same_lora
from pdcluster.engine.config import (
    DEFAULT_NUM_BLOCKS,
    DEFAULT_QUANTIZATION,
    DEFAULT_SCHEDULING_POLICY,
    DEFAULT_TENSOR_PARALLEL_SIZE,
    KV_SIZING_FIELDS,
    CacheConfig,
    EngineConfig,
    Quantization,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    kv_sizing_fields_set,
)
from pdcluster.routing.policy import DEFAULT_MIGRATION_LIMIT
from pdcluster.routing.role import Role


def _override_errors(role: str, exc: ValidationError) -> str:
    """`exc` of a role's engine overrides, each error located as `<role>.engine.<key>`."""
    parts = []
    for e in exc.errors():
        where = ".".join(map(str, (role, "engine", *e["loc"])))
        parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def without_replaced_kv_sizing(engine: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`engine` settings without their KV pool sizing when `overrides` size it another way:
    a role's (or a flag's) `kv_cache_memory_fraction` replaces the cluster's `num_blocks`."""
    if not overrides.keys() & set(KV_SIZING_FIELDS):
        return engine
    return {k: v for k, v in engine.items() if k not in KV_SIZING_FIELDS}


class EngineSettings(LoRASettings):
    """Per-instance engine settings (a role may override any of them; the LoRA ones are
    the same on every role that runs requests)."""

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(
        None, ge=1, description=f"KV blocks in each instance's pool (unset: {DEFAULT_NUM_BLOCKS}, "
        "or sized by kv_cache_memory_fraction or kv_cache_memory_bytes; set only one of the three)",
    )  # fmt: skip
    kv_cache_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="size the KV pool from memory: this share of the device's "
        "memory (GPU: total; CPU: the container's memory limit, else physical memory) holds "
        "the weights and the KV cache",
    )  # fmt: skip
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="size the KV pool to this many bytes"
    )
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    max_num_seqs: int = Field(128, ge=1, description="running requests at most")
    max_model_len: int = Field(2048, ge=2, description="prompt + output tokens at most")
    enable_prefix_caching: bool = Field(True, description="reuse KV of shared prompt prefixes")
    encoder_compute_budget: int = Field(4096, ge=1, description="encoder embeddings per step")
    encoder_cache_size: int = Field(8192, ge=1, description="encoder embeddings held at most")
    scheduling_policy: SchedulingPolicy = Field(
        DEFAULT_SCHEDULING_POLICY,
        description="'fcfs': arrival order; 'priority': by each request's priority (lower "
        "first, then arrival), preempting the worst when KV runs out",
    )
    device: str = Field("auto", description="'auto' (cuda if present), 'cpu', 'cuda', 'cuda:N'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="GPU: the model's dtype ('auto': bfloat16). CPU: the linear "
        "layers' weights (activations and KV stay float32); 'auto': float32 (exact) without a "
        "quantization, with one bf16 or float32 per layer and row count as measured at load; "
        "'float16' runs as 'bfloat16'",
    )
    quantization: Quantization = Field(
        DEFAULT_QUANTIZATION,
        description="'none': weights in dtype (float32 on CPU: exact); 'int8': per-channel "
        "int8 weights on CPU; 'int4': 4-bit weights in groups of 32 inputs on CPU (a Q4_1 "
        "GGUF's own grid); each for the row counts where it measures fastest at load, a float "
        "format for the rest (not exact)",
    )
    seed: int = Field(0, description="seed for weights-independent randomness")
    tensor_parallel_size: int = Field(
        DEFAULT_TENSOR_PARALLEL_SIZE, ge=1, description="ranks each instance's model is sharded "
        "over (rank 0 in the instance's actor, the others in worker actors on its node)",
    )  # fmt: skip
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads per instance (each rank); unset: its "
        "num_cpus (Ray's OMP_NUM_THREADS). More than its num_cpus lets a D that decodes alone "
        "use idle cores, at the price of contention when every instance is busy",
    )  # fmt: skip
    sim_time_scale: float | None = Field(
        None, gt=0, description="a sim: model runs every modeled duration this many times "
        "slower (unset: the profile's time_scale); instance stats count overrun steps",
    )  # fmt: skip
    speculative_config: dict[str, Any] | None = Field(
        None, description="speculative decoding, as vLLM spells it: e.g. {\"method\": "
        "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5} (also "
        "prompt_lookup_min, disable_by_batch_size); greedy outputs are unchanged. Set on the "
        "instances that decode (D, mixed); unset: none",
    )  # fmt: skip

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            SpeculativeConfig.from_dict(value)  # ValueError: pydantic reports it
        return value

    @model_validator(mode="after")
    def _check_kv_sizing(self) -> EngineSettings:
        kv_sizing_fields_set(self)
        return self


class RoleSpec(StrictSection):
    count: int = Field(0, ge=0, le=64, description="instances of this role")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per instance")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per instance")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources per instance, e.g. {'pdcluster_prefill': 1} to pin "
        "the role to a KubeRay worker group that declares it",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict, description="overrides of the cluster's engine settings"
    )
    drain_timeout_s: float = Field(
        600.0, gt=0, description="a leaving instance's time to finish what it holds; then it is "
        "removed and its streams move to live instances",
    )  # fmt: skip


class ConnectorSettings(StrictSection):
    kv_lease_s: float = Field(60.0, gt=0, description="P frees unacknowledged KV after this")
    kv_load_timeout_s: float = Field(60.0, gt=0, description="D gives up a KV read after this")
    ec_timeout_s: float = Field(30.0, gt=0, description="P encodes locally if E is this late")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="after a failed KV read: prefill on D, or fail the request"
    )
    kv_pool_size_gib: float | None = Field(
        None,
        ge=0,
        description="capacity of the cluster-wide KV pool in Ray's object store, GiB "
        "(0: no pool; unset: a share of the object store, KV_POOL_STORE_SHARE)",
    )


class RouterSettings(StrictSection):
    prefix_aware: bool = Field(True, description="prefer the P that caches the prompt prefix")
    prefix_slack_tokens: int = Field(2048, ge=0, description="queue slack for prefix affinity")
    disagg_min_prompt_tokens: int = Field(
        0, ge=0, description="prompts shorter than this are prefilled on D itself"
    )
    decode_prefix_fraction: float = Field(
        0.8, gt=0, le=1, description="prefill on D when D caches this fraction of the prompt"
    )
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="abort a request whose output nobody read for this long"
    )
    migration_limit: int = Field(
        DEFAULT_MIGRATION_LIMIT, ge=0, le=100, description="times a stream whose instance died "
        "moves to live instances and goes on (prompt + tokens so far) before it ends in an error",
    )  # fmt: skip


class GatewaySettings(StrictSection):
    host: str = Field("127.0.0.1", description="listen address (loopback by default)")
    port: int = Field(8000, ge=0, le=65535, description="listen port (0: any free port)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>'")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="request body limit")
    max_batch_prompts: int = Field(
        64, ge=1, le=4096, description="prompts one /v1/completions request may batch"
    )
    allowed_image_hosts: list[str] = Field(
        default_factory=list, description="hosts that http(s) image URLs may name (none: refuse)"
    )
    served_model_name: str | None = Field(
        None, description="model id in the API (default: folder name)"
    )
    replicas: int = Field(
        1, ge=1, le=64, description="gateway processes sharing the listen address (SO_REUSEPORT)"
    )
    stream_interval: int = Field(
        1, ge=1, le=1024, description="tokens a sequence gathers before its next streamed chunk "
        "(its first and last go at once); 1 streams each token as it comes, as vLLM's default",
    )  # fmt: skip
    chat_template: str | None = Field(
        None, description="a Jinja chat template used instead of the model's, or a file "
        "holding one (read when the config loads)",
    )  # fmt: skip
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="how messages' content reaches the template: as the template "
        "reads it (auto), one string, or a list of OpenAI-style parts",
    )  # fmt: skip
    enable_auto_tool_choice: bool = Field(
        False, description='serve tool_choice "auto" (the default with tools): calls read '
        "from the output by tool_call_parser",
    )  # fmt: skip
    tool_call_parser: str | None = Field(
        None, description=f"the format of auto tool calls: {', '.join(sorted(PARSERS))}"
    )
    num_cpus: float = Field(
        0.0, ge=0, description="CPUs each gateway replica reserves (Serve replicas, and the "
        "actors of `replicas`); above 0 they never land on a head started with num-cpus 0",
    )  # fmt: skip
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each gateway replica asks for, e.g. "
        "{'pdcluster_gateway': 1}: replicas go only to nodes (KubeRay worker groups) that "
        "declare it, never to the head",
    )

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value: str | None) -> str | None:
        if value is None or any(c in value for c in "{}\n"):
            return value  # None, or the template itself
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a chat template nor a file holding one")
        return path.read_text(encoding="utf-8")

    @model_validator(mode="after")
    def _check_tool_parser(self) -> GatewaySettings:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            known = ", ".join(sorted(PARSERS))
            raise ValueError(
                f"tool_call_parser {self.tool_call_parser!r} is unknown; known: {known}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (the calls' format)")
        return self

    def ray_actor_options(self) -> dict[str, Any]:
        """The Ray resources of one gateway replica actor."""
        return {"num_cpus": self.num_cpus, "resources": dict(self.resources)}


class RaySettings(StrictSection):
    address: str | None = Field(None, description="existing cluster (None: start a local one)")
    namespace: str = Field("pdcluster", description="Ray namespace of the named actors")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of an embedded local Ray")
    object_store_memory: int | None = Field(None, ge=75 * 1024 * 1024, description="bytes")


class ClusterConfig(StrictSection):
    model: str | None = Field(
        None, description="checkpoint folder, or 'preset:<name>' (default: preset:tiny-llava)"
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    encoder: RoleSpec = Field(default_factory=RoleSpec)
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    mixed: RoleSpec = Field(default_factory=RoleSpec)
    connector: ConnectorSettings = Field(default_factory=ConnectorSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    autoscale: AutoscaleSettings | None = Field(
        None, description="scale prefill and decode with load (None: fixed counts)"
    )

    @model_validator(mode="after")
    def _check_topology(self) -> ClusterConfig:
        if self.prefill.count + self.decode.count + self.mixed.count == 0:
            raise ValueError("a topology needs at least one prefill, decode or mixed instance")
        for role in Role:  # overrides must be valid engine settings
            try:
                self.engine_settings(role)
            except ValidationError as exc:
                raise ValueError(_override_errors(role, exc)) from None
        if self.prefill.count and self.decode.count:
            p, d = self.engine_settings(Role.PREFILL), self.engine_settings(Role.DECODE)
            if p.block_size != d.block_size:
                raise ValueError("prefill and decode must use the same block_size")
            if p.max_model_len != d.max_model_len:
                raise ValueError("prefill and decode must use the same max_model_len")
        self._check_autoscale_bounds()
        check_same_lora(self._runners())
        return self

    def _runners(self) -> list[EngineSettings]:
        """The engine settings of every role that runs requests (P, D, mixed: any may join)."""
        return [self.engine_settings(r) for r in (Role.PREFILL, Role.DECODE, Role.MIXED)]

    @property
    def lora(self) -> LoRASettings:
        """The LoRA settings, one for every role that runs requests (`check_same_lora`)."""
        return self._runners()[0]

    def _check_autoscale_bounds(self) -> None:
        """Each autoscaled role starts at its configured count, inside [min, max]."""
        for role in AUTOSCALED_ROLES:
            bounds = self.autoscale.role(role) if self.autoscale else None
            count = self.role(role).count
            if bounds and not bounds.min <= count <= bounds.max:
                raise ValueError(
                    f"{role}.count ({count}) must lie within autoscale.{role} "
                    f"[min {bounds.min}, max {bounds.max}]"
                )

    def role(self, role: Role | str) -> RoleSpec:
        return getattr(self, role)

    def engine_settings(self, role: str) -> EngineSettings:
        overrides = self.role(role).engine
        base = without_replaced_kv_sizing(self.engine.model_dump(), overrides)
        return EngineSettings(**{**base, **overrides})

    def engine_config(self, role: str, model_dir: str) -> EngineConfig:
        """The frozen engine config of one instance of `role`."""
        s = self.engine_settings(role)
        return EngineConfig(
            model=model_dir,
            cache=CacheConfig(
                block_size=s.block_size,
                num_blocks=s.num_blocks,
                kv_cache_memory_fraction=s.kv_cache_memory_fraction,
                kv_cache_memory_bytes=s.kv_cache_memory_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=s.max_num_batched_tokens,
                max_num_seqs=s.max_num_seqs,
                max_model_len=s.max_model_len,
                enable_prefix_caching=s.enable_prefix_caching,
                encoder_compute_budget=s.encoder_compute_budget,
                encoder_cache_size=s.encoder_cache_size,
                kv_load_failure_policy=self.connector.kv_load_failure_policy,
                scheduling_policy=s.scheduling_policy,
            ),
            device=s.device,
            dtype=s.dtype,
            quantization=s.quantization,
            seed=s.seed,
            sim_time_scale=s.sim_time_scale,
            tensor_parallel_size=s.tensor_parallel_size,
            num_threads=s.num_threads,
            speculative=(
                None
                if s.speculative_config is None
                else SpeculativeConfig.from_dict(s.speculative_config)
            ),
            lora=s.lora_config(),
        )

    def priority_scheduling(self) -> bool:
        """Whether every instance that schedules requests (P, D, mixed: any may join later)
        runs the priority policy, so that a request's priority is honoured wherever it goes."""
        return all(s.scheduling_policy == "priority" for s in self._runners())

    def served_model_name(self, model: str) -> str:
        """The model id clients use: the configured name, else the preset or folder name of
        `model` (the model this cluster serves)."""
        name = self.gateway.served_model_name or model
        return name.removeprefix("preset:").rstrip("/").rsplit("/", 1)[-1]

    def topology_name(self) -> str:
        letters = {Role.ENCODER: "E", Role.PREFILL: "P", Role.DECODE: "D", Role.MIXED: "mixed"}
        return "".join(f"{self.role(r).count}{letters[r]}" for r in Role if self.role(r).count)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        """The config in a YAML file, or in a built-in topology named like 'local-1p1d'."""
        return cls.load(path)

    @classmethod
    def load(
        cls, name_or_path: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> ClusterConfig:
        """A YAML config (a path or a built-in name; None: none) with `overrides` on top, all
        validated together. Errors are one ValueError naming the file and the fields."""
        path = None if name_or_path is None else config_path(name_or_path)
        base, overrides = read_yaml(path) if path else {}, overrides or {}
        if isinstance(base.get("engine"), dict) and isinstance(overrides.get("engine"), dict):
            base["engine"] = without_replaced_kv_sizing(base["engine"], overrides["engine"])
        data = merge(base, overrides)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            source = f"{path} with the command-line flags" if overrides else str(path)
            prefix = f"{source}: " if path else ""
            raise ValueError(f"{prefix}invalid config: {describe_errors(exc)}") from None
