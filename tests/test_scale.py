"""The cluster at scale on the simulator: many instances behind two gateway replicas, every
stream of a load held open at once, each ending with exactly the tokens the deterministic sim
generator gives for its prompt, and nothing left behind on any instance."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx
import pytest
import ray

from benchmarks.workload import PACKAGED_TRACE, LengthScaling, token_prompt, trace_workload
from cluster.config import ClusterConfig
from cluster.control.launch import Cluster, launch
from cluster.replicas import gateway_app, start_replicas
from engine import LLM, SamplingParams
from tests.cluster_utils import assert_clean, live_object_ids, wait_until
from tests.gateway_utils import running

SIM_8B = "sim:h100-llama-3.1-8b"
MODEL = "sim"
ENGINE = {"block_size": 16, "num_blocks": 1024, "max_model_len": 512, "max_num_seqs": 256}
# Short prompts and outputs of the packaged Azure conversation sample: many streams, few tokens.
LENGTHS = LengthScaling(token_scale=0.05, max_prompt_len=96, max_output_len=24)
TIME_SCALE = 10.0  # modeled steps run 10x slower: the host keeps up with 16-32 modeled GPUs


@dataclass(frozen=True)
class Stream:
    prompt: list[int]
    max_tokens: int


def _streams(num: int) -> list[Stream]:
    """`num` requests with the lengths of the trace sample's first ones, distinct prompts."""
    workload = trace_workload(PACKAGED_TRACE, LENGTHS, num_requests=num)
    rng = random.Random(0)
    return [Stream(token_prompt(r.prompt_len, rng), r.output_len) for r in workload.requests]


def _expected(streams: list[Stream]) -> list[list[int]]:
    """What the deterministic sim generator gives for each prompt, colocated in process."""
    llm = LLM(SIM_8B, **ENGINE)
    params = [SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
              for s in streams]  # fmt: skip
    return [o.token_ids for o in llm.generate([s.prompt for s in streams], params)]


def _config(num_prefill: int, num_decode: int, num_cpus: float) -> ClusterConfig:
    role = {"num_cpus": num_cpus}
    return ClusterConfig.model_validate({
        "model": SIM_8B,
        "engine": {**ENGINE, "sim_time_scale": TIME_SCALE},
        "prefill": {"count": num_prefill, **role},
        "decode": {"count": num_decode, **role},
        "gateway": {"served_model_name": MODEL},
    })  # fmt: skip


async def _stream(client: httpx.AsyncClient, url: str, stream: Stream) -> list[int] | str:
    """The token ids one streamed completion carried (from its logprobs), or what went wrong."""
    body = {"model": MODEL, "prompt": stream.prompt, "max_tokens": stream.max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip
    token_ids: list[int] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            finish = None
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    token_ids += [int(t.removeprefix("token_id:")) for t in tokens]
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return token_ids if finish == "length" else f"finish_reason {finish!r}"


def _in_flight(cluster: Cluster, replica: ray.actor.ActorHandle) -> int:
    return cluster.front.num_in_flight() + ray.get(replica.counts.remote())[1]


def run_streams(num_prefill: int, num_decode: int, num_streams: int, num_cpus: float) -> None:
    """`num_streams` streams through two replicas, all open at once: the instances are paused
    until every stream is in flight on a replica, then stepped to the end."""
    streams = _streams(num_streams)
    expected = _expected(streams)
    with launch(_config(num_prefill, num_decode, num_cpus)) as cluster:
        baseline = live_object_ids()
        with running(gateway_app(cluster)) as url:
            port = int(url.rsplit(":", 1)[1])
            replica = start_replicas(cluster.config, cluster.pool, "127.0.0.1", port, 1)[0]
            try:
                assert wait_until(lambda: ray.get(replica.started.remote()), 120)
                handles = [h for _, h in cluster.instances.values()]
                ray.get([h.pause.remote() for h in handles])

                async def load() -> list[list[int] | str]:
                    limits = httpx.Limits(max_connections=None)
                    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                        tasks = [asyncio.ensure_future(_stream(client, url, s)) for s in streams]
                        while _in_flight(cluster, replica) < num_streams:
                            assert not any(t.done() for t in tasks), "a stream ended while paused"
                            await asyncio.sleep(0.1)
                        ray.get([h.resume.remote() for h in handles])
                        return list(await asyncio.gather(*tasks))

                outcomes = asyncio.run(load())
                assert outcomes == expected  # every stream whole, token for token
                started, in_flight = ray.get(replica.counts.remote())
                assert started > 0 and cluster.front.num_started > 0  # both replicas served
                assert started + cluster.front.num_started == num_streams and in_flight == 0
                view = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instances"]
                assert all(i["sim_time_scale"] == TIME_SCALE and i["sim_steps"] > 0 for i in view)
            finally:
                ray.kill(replica, no_restart=True)
                replica = None  # a killed replica's handle is no object to account for
        assert_clean(cluster, baseline, timeout_s=60)  # all blocks free on every instance
        stats = cluster.stats()
    assert len(stats) == num_prefill + num_decode
    # every stream went P -> D: its KV through the connector, one load on its D
    assert sum(s.get("num_loads", 0) for s in stats if s["role"] == "decode") == num_streams


def test_sixteen_sim_instances_two_replicas_200_streams(ray_session):
    run_streams(num_prefill=4, num_decode=12, num_streams=200, num_cpus=0.25)


@pytest.mark.slow
def test_thirty_two_sim_instances_two_replicas_1024_streams(ray_session):
    run_streams(num_prefill=8, num_decode=24, num_streams=1024, num_cpus=0.125)
