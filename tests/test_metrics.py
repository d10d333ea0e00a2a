"""Metrics under vLLM's names: the gateway's /metrics, the instances' own series through
Ray's metrics agent, and what the gateway counts when a client hangs up or an instance dies
(a 503 with Retry-After), and that /v1/cluster reports an unreachable instance rather than
waiting for it."""

from __future__ import annotations

import concurrent.futures
import urllib.request

import httpx
import pytest
import ray
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.actors.pool_messages import PlannerState
from pdcluster.cluster.api.metrics import GatewayMetrics, token_buckets
from pdcluster.engine import SamplingParams
from pdcluster.routing.role import Role
from tests.cluster_utils import assert_clean, handle, live_object_ids, start, wait_until

MODEL = "metrics-model"
NO_EOS = {"ignore_eos": True}
RESTART_TIMEOUT_S = 120.0  # a restarted instance loads its model again
RAY_EXPORT_TIMEOUT_S = 60.0  # Ray's agent exports what workers recorded every few seconds


@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    """With migration_limit 0: a request whose instance dies fails (the 503 below) instead
    of moving (tests/test_cluster_faults.py)."""
    gateway, router = {"served_model_name": MODEL}, {"migration_limit": 0}
    with start(model_dir, prefill=1, decode=1, gateway=gateway, router=router) as c:
        yield c


@pytest.fixture
def baseline(cluster):
    ids = live_object_ids()
    yield ids
    assert_clean(cluster, ids)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    return samples(httpx.get(f"{base_url}/metrics").text)


def value(metrics: dict, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and wanted <= ls)


def has(metrics: dict, name: str, **labels: str) -> bool:
    """Whether a series of `name` has (at least) these labels."""
    wanted = set(labels.items())
    return any(n == name and wanted <= ls for n, ls in metrics)


def completion(base_url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **NO_EOS, **extra}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def test_vllm_names_with_model_name(base_url, cluster, baseline):
    before = scrape(base_url)
    assert completion(base_url, "count me", 5).status_code == 200
    after = scrape(base_url)
    model = {"model_name": MODEL}

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **model, **labels) - value(before, name, **model, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:prompt_tokens_total") > 0
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert grew(f"{histogram}_count") == 1, histogram
    assert grew("vllm:inter_token_latency_seconds_count") == 4
    generated = value(after, "vllm:request_generation_tokens_bucket", le="5.0", **model)
    assert generated - value(before, "vllm:request_generation_tokens_bucket", le="5.0") == 1
    ok = {"endpoint": "/v1/completions", "status": "200"}
    http = "pdcluster_http_requests_total"
    assert value(after, http, **ok) - value(before, http, **ok) == 1
    for role in ("prefill", "decode"):
        engine = {"engine": _id(cluster, role), "role": role, **model}
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert has(after, gauge, **engine), gauge
        assert value(after, "vllm:kv_cache_usage_perc", **engine) == 0.0  # all freed again
        assert has(after, "vllm:num_preemptions_total", **engine)
        assert has(after, "vllm:prefix_cache_hits_total", **engine)
        assert value(after, "vllm:prefix_cache_queries_total", **engine) > 0


def test_http_statuses_counted(base_url):
    before = scrape(base_url)
    assert completion(base_url, "x", 0).status_code == 400  # max_tokens must be >= 1
    assert httpx.get(f"{base_url}/no/such/path").status_code == 404
    after = scrape(base_url)
    for endpoint, status in (("/v1/completions", "400"), ("other", "404")):
        labels = {"endpoint": endpoint, "status": status}
        grew = value(after, "pdcluster_http_requests_total", **labels) - value(
            before, "pdcluster_http_requests_total", **labels
        )
        assert grew == 1, labels


def test_the_kv_pool_in_metrics_and_the_cluster_view(base_url, baseline):
    before = scrape(base_url)
    assert completion(base_url, "a prompt the KV pool keeps " * 4, 5).status_code == 200

    def pool_view() -> dict:
        return httpx.get(f"{base_url}/v1/cluster").json()["kv_pool"] or {}

    assert wait_until(lambda: pool_view().get("num_bytes", 0) > 0)  # the publish is async
    pool = pool_view()
    assert pool["num_bytes"] <= pool["capacity_bytes"] and pool["num_entries"] >= 1
    after = scrape(base_url)
    assert value(after, "pdcluster_kv_pool_bytes") > 0
    assert value(after, "pdcluster_kv_pool_entries") >= 1
    # P looked the new prompt up (a miss) and published it; D published the reply's blocks.
    misses = value(after, "pdcluster_kv_pool_misses_total", role="prefill")
    assert misses - value(before, "pdcluster_kv_pool_misses_total", role="prefill") == 1
    assert value(after, "pdcluster_kv_pool_published_bytes_total", role="prefill") > 0
    assert has(after, "pdcluster_kv_pool_load_latency_seconds_count", role="prefill")


def test_token_buckets_follow_vllm():
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]


def test_planner_round_time_is_exported_once_a_round_ran():
    metrics = GatewayMetrics(MODEL, max_model_len=64)
    metrics.instances.planner = PlannerState({Role.PREFILL: 1})
    name = "pdcluster_planner_round_seconds"
    assert not any(n == name for n, _ in samples(generate_latest(metrics.registry).decode()))
    metrics.instances.planner = PlannerState({Role.PREFILL: 1}, round_s=0.25)
    assert samples(generate_latest(metrics.registry).decode())[(name, frozenset())] == 0.25


@pytest.mark.parametrize("stream", [False, True])
def test_client_hang_up_counted_as_abort(base_url, cluster, baseline, stream):
    """The request is held on a paused D; the client gives up: request_success counts an
    abort and the e2e histogram the request."""
    decode = handle(cluster, "decode")
    ray.get(decode.pause.remote())
    try:
        before = scrape(base_url)
        body = {"model": MODEL, "prompt": "hang up", "max_tokens": 8, "stream": stream, **NO_EOS}
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=1.0) as response,
        ):
            for _ in response.iter_lines():  # P's first token, then nothing
                pass

        def counted() -> bool:
            after = scrape(base_url)
            return all(
                value(after, name, model_name=MODEL, **labels)
                == value(before, name, model_name=MODEL, **labels) + 1
                for name, labels in (
                    ("vllm:request_success_total", {"finished_reason": "abort"}),
                    ("vllm:e2e_request_latency_seconds_count", {}),
                )
            )

        assert wait_until(counted), scrape(base_url)
    finally:
        ray.get(decode.resume.remote())


def test_ray_metrics_export(cluster, baseline):
    """Every instance's own series reach Ray's metrics agent (what KubeRay's Prometheus
    scrapes), named `ray_vllm_*` and tagged with the model name, instance id and role."""
    cluster.generate("exported", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    node = next(n for n in ray.nodes() if n["Alive"])
    port = node.get("MetricsExportPort")
    if not port:
        pytest.skip("this Ray node has no metrics export port")
    url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError as exc:
        pytest.skip(f"Ray's metrics agent does not serve {url}: {exc}")
    decode = {"model_name": MODEL, "engine": _id(cluster, "decode"), "role": "decode"}
    wanted = [
        (name, {"model_name": MODEL, "engine": iid, "role": role})
        for iid, (role, _) in cluster.instances.items()
        for name in (
            "ray_vllm_num_requests_running",
            "ray_vllm_num_requests_waiting",
            "ray_vllm_kv_cache_usage_perc",
            "ray_vllm_prefix_cache_queries_total",
            "ray_vllm_prompt_tokens_total",
            "ray_vllm_generation_tokens_total",
        )
    ]
    found: dict = {}

    def exported() -> bool:
        found.clear()
        found.update(samples(urllib.request.urlopen(url, timeout=5).read().decode()))
        return value(found, "ray_vllm_generation_tokens_total", **decode) >= 3 and all(
            has(found, name, **labels) for name, labels in wanted
        )  # P generated the first token, D the other 3

    assert wait_until(exported, RAY_EXPORT_TIMEOUT_S), [
        (name, labels) for name, labels in wanted if not has(found, name, **labels)
    ]


def test_dead_instance_gives_503_and_cluster_view_is_bounded(base_url, cluster, baseline):
    """D dies while a non-streaming request is parked on it, with no move left: the client
    gets 503 with Retry-After; meanwhile /v1/cluster answers, naming D unreachable, without waiting for
    its restart."""
    decode_id = _id(cluster, "decode")
    decode = handle(cluster, "decode")
    ray.get(decode.pause.remote())
    pid = next(s.pid for s in cluster.stats() if s.instance_id == decode_id)
    with httpx.Client(timeout=60) as client:
        body = {"model": MODEL, "prompt": "lose D", "max_tokens": 8, **NO_EOS}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.post, f"{base_url}/v1/completions", json=body)
            assert wait_until(
                lambda: any(
                    s.instance_id == decode_id and s.scheduler.num_waiting for s in cluster.stats()
                )
            )
            ray.kill(decode, no_restart=False)
            response = pending.result()
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"].isdigit()
    assert decode_id in response.json()["error"]["message"]

    def unreachable() -> bool:
        view = httpx.get(f"{base_url}/v1/cluster", timeout=30).json()["instances"]
        return any(i["id"] == decode_id and not i["reachable"] for i in view)

    assert wait_until(unreachable, RESTART_TIMEOUT_S)

    def back() -> bool:
        s = next(s for s in cluster.stats() if s.instance_id == decode_id)
        return s.healthy and s.pid not in (None, pid)

    assert wait_until(back, RESTART_TIMEOUT_S)


def _id(cluster, role: str) -> str:
    return next(iid for iid, (r, _) in cluster.instances.items() if r == role)
