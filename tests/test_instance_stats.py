"""InstanceStats: every figure an engine and its connectors report reaches a typed field, and
the gateway's views and metrics read it. No Ray cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any

from pdcluster.actors.messages import InstanceStats, SchedulerStats
from pdcluster.cluster.api.app import _instance_view
from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.cluster.control.launch import Cluster
from pdcluster.connectors.multi import MultiKVConnector
from pdcluster.connectors.ray_ec import RayECConnector
from pdcluster.connectors.ray_kv import RayKVConnector
from pdcluster.connectors.ray_kv_pool import RayKVPoolConnector
from pdcluster.connectors.stats import KVConnectorStats, KVPoolUse, KVTransferStats
from pdcluster.engine import LLM, SamplingParams

SIM_ENGINE = {"block_size": 4, "num_blocks": 64, "max_model_len": 128}


def engine_keys(preset_dir) -> set[str]:
    """The keys of the plain counters an instance's engine may report."""
    keys = set(LLM(preset_dir("tiny-llama"), num_blocks=16).engine.stats())
    keys |= set(LLM("sim:h100-llama-3.1-8b", **SIM_ENGINE).engine.stats())
    return keys | {"tensor_parallel_size", "tp_worker_pids", "tp_worker_actor_ids"}


def handoff_and_pool() -> MultiKVConnector:
    """A P's KV connector: the handoff to D and the cluster KV pool (no pool actor)."""
    return MultiKVConnector(
        [RayKVConnector("P0", "producer", block_size=4), RayKVPoolConnector(None, block_size=4)]
    )


def connector_parts() -> dict[str, Any]:
    """The typed parts an instance's connectors report, under `EngineCore.stats()`'s keys."""
    kv = handoff_and_pool().stats()
    return {
        "kv_transfer": kv.kv_transfer,
        "kv_pool": kv.kv_pool,
        "ec": RayECConnector("consumer").stats(),
    }


def leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [v for item in value.values() for v in leaves(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in leaves(item)]
    return [value]


def test_every_engine_figure_lands_in_a_typed_field(preset_dir):
    counter = itertools.count(1000)
    flat = {
        key: [next(counter)] if key.startswith("tp_worker_") else next(counter)
        for key in sorted(engine_keys(preset_dir))
    }
    parts = connector_parts()
    stats = InstanceStats.from_engine({**flat, **parts}, instance_id="P0", role="prefill")
    found = set(leaves(dataclasses.asdict(stats)))
    lost = sorted(k for k, v in flat.items() if not set(leaves(v)) <= found)
    assert not lost, f"engine figures without a field: {lost}"
    assert {name: getattr(stats, name) for name in parts} == parts  # as the connectors gave them
    assert stats.sim is not None


def test_an_engine_carries_its_connectors_parts_as_they_report_them(preset_dir):
    kv = handoff_and_pool()
    llm = LLM(preset_dir("tiny-llama"), block_size=4, num_blocks=16, kv_connector=kv)
    stats = llm.engine.stats()
    assert (stats["kv_transfer"], stats["kv_pool"]) == (kv.stats().kv_transfer, kv.stats().kv_pool)
    assert stats["kv_transfer"].transfer_ms_histogram.count == 0
    assert "ec" not in stats  # no EC connector


def test_a_combination_reports_each_field_from_the_first_connector_that_has_it():
    pool = KVConnectorStats(kv_pool=KVPoolUse(hits=1), num_pending_sends=5)
    combined = KVConnectorStats.combined([KVConnectorStats(num_pending_sends=2), pool])
    assert combined == KVConnectorStats(kv_pool=KVPoolUse(hits=1), num_pending_sends=2)
    assert KVConnectorStats.combined([]) == KVConnectorStats()


def test_an_encoder_reports_its_queue_only():
    stats = InstanceStats.from_engine(
        {"num_waiting": 2, "num_blocks_total": 0, "num_blocks_free": 0},
        instance_id="E0",
        role="encoder",
    )
    assert stats.scheduler == SchedulerStats(num_waiting=2)
    assert stats.sim is None and stats.tensor_parallel.size == 1
    assert not stats.is_idle()


def test_idle_means_nothing_held():
    idle = InstanceStats("D0", "decode", scheduler=SchedulerStats(8, 8))
    assert idle.is_idle()
    assert not dataclasses.replace(idle, scheduler=SchedulerStats(8, 7)).is_idle()
    assert not dataclasses.replace(idle, num_streams=1).is_idle()
    assert not dataclasses.replace(idle, kv_pool=KVPoolUse(pending_loads=1)).is_idle()
    assert not dataclasses.replace(
        idle, scheduler=SchedulerStats(8, 8, num_pending_recvs=1)
    ).is_idle()


def test_cluster_view_of_an_instance():
    sched = SchedulerStats(num_blocks_total=8, num_blocks_free=6, num_running=1,
                           num_pending_sends=2, num_pending_recvs=1)  # fmt: skip
    stats = InstanceStats("P0", "prefill", num_pulls=5, num_streams=1, scheduler=sched,
                          epoch="e1", kv_transfer=KVTransferStats(checksum_failures=2),
                          kv_pool=KVPoolUse(checksum_failures=1))  # fmt: skip
    assert _instance_view(stats) == {
        "id": "P0", "role": "prefill", "healthy": True, "reachable": True,
        "num_blocks_total": 8, "num_blocks_free": 6, "num_running": 1, "num_waiting": 0,
        "num_deferred": 0, "num_pending_transfers": 3, "num_pulls": 5, "num_streams": 1,
        "epoch": "e1", "transfer_checks": {
            "kv_checksum_failures": 3, "ec_checksum_failures": 0, "kv_acks_refused": 0,
        },
    }  # fmt: skip
    gone = _instance_view(InstanceStats.unreachable("D0", "decode"))
    assert (gone["healthy"], gone["reachable"], gone["num_blocks_total"]) == (False, False, 0)


def test_gateway_metrics_read_instance_stats():
    metrics = GatewayMetrics("m", max_model_len=64)
    sched = SchedulerStats(num_blocks_total=10, num_blocks_free=4, num_running=3)
    metrics.instances.snapshot = [
        InstanceStats("D0", "decode", scheduler=sched),
        InstanceStats.unreachable("D1", "decode"),
    ]
    samples = {
        (s.name, s.labels.get("engine") or s.labels.get("instance")): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert samples[("vllm:num_requests_running", "D0")] == 3
    assert samples[("vllm:kv_cache_usage_perc", "D0")] == 0.6
    assert samples[("pdcluster_instance_healthy", "D1")] == 0.0
    assert ("vllm:num_requests_running", "D1") not in samples  # no answer: no series


def test_an_engine_that_speculates_reports_its_drafts_to_the_view_and_metrics(preset_dir):
    speculative = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(preset_dir("tiny-llama"), num_blocks=32, speculative_config=speculative)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=24))
    engine = llm.engine.stats()
    stats = InstanceStats.from_engine(engine, instance_id="D0", role="decode")
    drafts = stats.spec_decode
    assert drafts == engine["spec_decode"] and drafts.num_drafts > 0
    assert _instance_view(stats)["spec_decode"]["num_draft_tokens"] == drafts.num_draft_tokens
    assert InstanceStats.from_engine({}, instance_id="D1", role="decode").spec_decode is None

    metrics = GatewayMetrics("m", max_model_len=64)
    metrics.instances.snapshot = [stats]
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == drafts.num_drafts
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == (
        drafts.num_accepted_tokens
    )
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", p)] for p in "01"]
    assert per_pos == drafts.num_accepted_tokens_per_pos


def test_wait_idle_returns_once_every_healthy_instance_holds_nothing():
    busy = InstanceStats("D0", "decode", scheduler=SchedulerStats(8, 7))
    snapshots = iter([[busy], [dataclasses.replace(busy, scheduler=SchedulerStats(8, 8))]])
    cluster = Cluster.__new__(Cluster)
    cluster.stats = lambda: next(snapshots)  # type: ignore[method-assign]
    (idle,) = Cluster.wait_idle(cluster, timeout_s=5)
    assert idle.is_idle()


def test_the_gcs_probe_reads_a_gcs_that_does_not_answer_as_unreachable(monkeypatch):
    """A question to a GCS that is down waits: the probe answers "unreachable" after its
    timeout, asks nothing more while that question is pending, and "reachable" once it is
    answered."""
    import threading

    import ray

    from pdcluster.actors.ray_runtime import GcsProbe

    answer, calls = threading.Event(), []

    def list_named_actors() -> list:
        calls.append(1)
        answer.wait(30)
        return []

    monkeypatch.setattr(ray.util, "list_named_actors", list_named_actors)

    async def scenario() -> list[bool]:
        probe = GcsProbe()
        down = [await probe.reachable(0.05), await probe.reachable(0.05)]
        answer.set()
        return [*down, await probe.reachable(5.0)]

    assert asyncio.run(scenario()) == [False, False, True]
    assert len(calls) == 1  # the second probe waited on the first question
