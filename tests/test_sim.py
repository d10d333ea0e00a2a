"""The simulated engine (`sim:PROFILE`): deterministic tokens, modeled step and transfer
times, the profile fit, and a sim cluster that behaves (and cleans up) like a real one."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest
import ray
import torch

from pdcluster.benchmarks import sim_validation
from pdcluster.cluster.cli import main as cli_main
from pdcluster.cluster.config import ClusterConfig
from pdcluster.connectors.ray_kv import RayKVConnector, RayKVConnectorMetadata, RayKVLoad
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.config import CacheConfig
from pdcluster.engine.models.loader import read_model_info
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.engine.sim import fit as sim_fit
from pdcluster.engine.sim.profile import (
    SimProfile,
    StepCoefficients,
    StepShape,
    StepTimeModel,
    builtin_profiles,
    load_profile,
)
from pdcluster.engine.sim.runner import SimRunner
from tests.cluster_utils import (
    GREEDY,
    assert_clean,
    collect,
    instance_stats,
    live_object_ids,
    mixed_prompts,
    random_image,
    start,
    until,
)

SIM_8B = "sim:h100-llama-3.1-8b"
ENGINE = {"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 256, "max_model_len": 512}


def _profile_file(tmp_path, **fields) -> str:
    """A copy of the 8B profile with `fields` replaced, as a JSON file."""
    data = load_profile("h100-llama-3.1-8b").model_dump(mode="json") | fields
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return f"sim:{path}"


class FakeClock:
    """Time that moves only when slept on or advanced by hand."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


# ---- the runner, in process --------------------------------------------------------------
def test_sim_llm_is_deterministic_and_honours_stops(tmp_path):
    model = _profile_file(tmp_path, eos_probability=0.2)
    prompts = mixed_prompts(with_images=False)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    first = LLM(model, **ENGINE).generate(prompts, params)
    again = LLM(model, **ENGINE).generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert [o.text for o in first] == [o.text for o in again]
    eos = read_model_info(resolve_model_dir(model)).eos_token_ids[0]
    # EOS ends some outputs early at 20% per token; ignore_eos never emits it.
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 40 for o in first)
    ignored = LLM(model, **ENGINE).generate(prompts, dataclasses.replace(params, ignore_eos=True))
    assert all(len(o.token_ids) == 40 and eos not in o.token_ids for o in ignored)
    # A stop token id ends the stream where that id first appears.
    stream = ignored[1].token_ids
    stop = dataclasses.replace(params, ignore_eos=True, stop_token_ids=[stream[5]])
    (stopped,) = LLM(model, **ENGINE).generate([prompts[1]], stop)
    assert stopped.token_ids == stream[: stream.index(stream[5]) + 1]
    assert stopped.finish_reason == "stop"


def test_sim_logprobs_are_a_plausible_distribution():
    llm = LLM(SIM_8B, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    (out,) = llm.generate(["Hello"], params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 8 and all(lp < 0 for lp in completion.logprobs)
    for token_id, top in zip(completion.token_ids, completion.top_logprobs):
        assert top.token_ids[0] == token_id and len(set(top.token_ids)) == 3
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert sum(np.exp(top.logprobs)) <= 1.0


def _runner(clock: FakeClock, coefficients: StepCoefficients, time_scale: float) -> SimRunner:
    profile = load_profile("h100-llama-3.1-8b").model_copy(update={"step": coefficients})
    info = read_model_info(resolve_model_dir(SIM_8B))
    cache = CacheConfig(block_size=4, num_blocks=16)
    return SimRunner(profile, info, cache, frozenset(), time_scale, clock, clock.sleep)


def _prefill(req_id: str, num_tokens: int) -> SchedulerOutput:
    new = NewRequestData(req_id, list(range(10, 10 + num_tokens)), [], GREEDY, [0, 1], 0)
    return SchedulerOutput(
        [new], CachedRequestData(), {req_id: num_tokens}, num_tokens, {}, set(), []
    )


def test_a_step_sleeps_until_its_scaled_modeled_time_and_counts_overruns():
    clock = FakeClock()
    coefficients = StepCoefficients(prefill_base_s=0.01, prefill_per_token_s=0.001)
    runner = _runner(clock, coefficients, time_scale=4.0)
    out = runner.execute_model(_prefill("a", 6))
    assert out.sampled_token_ids[0]  # the whole prompt ran: one token sampled
    assert clock.slept == [pytest.approx(4 * (0.01 + 6 * 0.001))]  # one sleep, no spin
    assert runner.stats()["sim_steps_overrun"] == 0

    class SlowHost(FakeClock):  # every clock read costs 1 s of host time
        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    slow = SlowHost()
    runner = _runner(slow, coefficients, time_scale=1.0)
    runner.execute_model(_prefill("b", 6))
    assert slow.slept == [] and runner.stats()["sim_steps_overrun"] == 1


# ---- profiles ------------------------------------------------------------------------------
def test_builtin_gpu_profiles_are_sourced_estimates_with_the_modeled_kv_shape():
    assert {"h100-llama-3.1-8b", "h100-llama-3.1-70b-tp4"} <= set(builtin_profiles())
    p8, p70 = load_profile("h100-llama-3.1-8b"), load_profile("h100-llama-3.1-70b-tp4")
    for profile in (p8, p70):
        assert profile.estimate and profile.sources and "ESTIMATE" in profile.description
        assert profile.step.encoder_per_image_s > 0  # a vision-encoder cost for E
    assert p8.kv.bytes_per_token == 128 * 1024  # 32 layers x 8 KV heads x 128 x K,V x bf16
    assert p70.kv.bytes_per_token == 320 * 1024
    # A 70B decode step is slower than an 8B one at the same batch.
    shape = StepShape(decode_contexts=(1000,) * 32)
    assert StepTimeModel.of(p70).step_s(shape) > StepTimeModel.of(p8).step_s(shape)


def test_a_mixed_step_pays_its_fixed_cost_once():
    timing = StepTimeModel.of(load_profile("h100-llama-3.1-8b"))
    prefill, decode = ((256, 0), (64, 512)), (512,) * 8
    alone = timing.step_s(StepShape(prefill)) + timing.step_s(StepShape(decode_contexts=decode))
    c = timing.step  # one forward pass reads the weights once
    assert timing.step_s(StepShape(prefill, decode)) == pytest.approx(
        alone - min(c.prefill_base_s, c.decode_base_s)
    )


def test_the_multimodal_profile_expands_an_image_to_its_towers_tokens_and_charges_its_encode():
    profile = load_profile("h100-llava-llama-3.1-8b")  # the schema validates the file
    assert profile.estimate and "ESTIMATE" in profile.description and profile.sources
    assert profile.vision.num_image_tokens == 576  # CLIP ViT-L/14 at 336 px
    assert profile.step.encoder_per_image_s > 0
    model = "sim:h100-llava-llama-3.1-8b"
    engine = {**ENGINE, "max_num_batched_tokens": 1024, "max_model_len": 1024}
    llm = LLM(model, **engine)
    image = {"prompt": "Describe <image> please.", "multi_modal_data": {"image": random_image(1)}}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    (with_image,) = llm.generate([image], params)
    image_id = read_model_info(resolve_model_dir(model)).image_token_id
    assert with_image.prompt_token_ids.count(image_id) == 576
    busy_s = llm.engine.runner.stats()["sim_modeled_busy_s"]
    # The same prompt length as text only, on a fresh engine: no encoder time in its steps.
    text = LLM(model, **engine)
    text.generate([{"prompt_token_ids": with_image.prompt_token_ids[:1] * 585}], params)
    encode_s = profile.step.encoder_base_s + profile.step.encoder_per_image_s
    assert busy_s - text.engine.runner.stats()["sim_modeled_busy_s"] == pytest.approx(encode_s)


def test_a_vision_shape_needs_a_llava_style_tokenizer_model(tmp_path):
    model = _profile_file(tmp_path, vision={"image_size": 336, "patch_size": 14})
    with pytest.raises(ValueError, match="must be a LLaVA-style model"):
        resolve_model_dir(model)  # the 8B profile's tokenizer is the text-only tiny-llama


def test_an_unknown_profile_names_the_builtin_ones():
    with pytest.raises(ValueError, match="h100-llama-3.1-8b"):
        resolve_model_dir("sim:no-such-profile")


def test_fit_recovers_the_coefficients_of_a_known_step_model():
    truth = StepCoefficients(
        prefill_base_s=0.02,
        prefill_per_token_s=3e-4,
        prefill_per_token_context_s=2e-7,
        decode_base_s=0.015,
        decode_per_seq_s=1e-3,
        decode_per_context_token_s=4e-6,
        mixed_base_s=0.025,
    )
    clock = FakeClock()
    model = StepTimeModel(truth, 0, 1.0, 0.0)

    class ModeledRunner:  # takes exactly the true model's time per step
        def execute_model(self, so: SchedulerOutput) -> None:
            cached = so.scheduled_cached_reqs  # a decode shape's timed steps continue
            rows = [
                (so.num_scheduled_tokens[r.req_id], r.num_computed_tokens)
                for r in so.scheduled_new_reqs
            ] + [(1, c) for c in cached.num_computed_tokens]
            prefill = tuple((n, c) for n, c in rows if n > 1)
            decode = tuple(c for n, c in rows if n == 1)
            clock.now += model.step_s(StepShape(prefill, decode))

    points = sim_fit.measure(ModeledRunner(), sim_fit.grid(), 16, 10, repeats=1, clock=clock)
    coefficients, report = sim_fit.fit(points)
    assert report.max_rel_error < 1e-6
    for name, value in truth.model_dump().items():
        assert getattr(coefficients, name) == pytest.approx(value, rel=1e-4, abs=1e-12)


def test_profile_command_fits_a_real_engine_and_reproduces_its_points(tmp_path):
    out = tmp_path / "tiny.json"
    argv = ["profile", "--model", "preset:tiny-llama", "--out", str(out), "--repeats", "1"]
    argv += ["--threads", "1"]  # an instance's torch threads: Ray gives it its num_cpus
    argv += ["--prefill-tokens", "8", "32", "64", "--prefill-contexts", "0", "16"]
    argv += ["--decode-seqs", "1", "4", "--decode-contexts", "16", "64"]
    assert cli_main(argv) == 0
    profile = SimProfile.model_validate_json(out.read_text())
    assert profile.tokenizer == "preset:tiny-llama" and not profile.estimate
    assert "1 torch threads" in profile.description
    assert (
        profile.kv.num_layers == read_model_info(resolve_model_dir("preset:tiny-llama")).num_layers
    )
    timing = StepTimeModel.of(profile)
    assert len(profile.fit.points) == 6 + 4 + 2  # prefill, decode, mixed
    for row in profile.fit.points:  # the stated error is the error at the measured points
        point = sim_fit.point_of(row)
        error = abs(timing.step_s(point.shape) - point.seconds) / point.seconds
        assert error <= profile.fit.max_rel_error + 1e-3
    # And the fitted profile serves: same prompt lengths as the real model's tokenizer.
    llm = LLM(f"sim:{out}", **ENGINE)
    assert llm.generate(["Hello there"], GREEDY)[0].prompt_token_ids == (
        LLM("preset:tiny-llama", **ENGINE).generate(["Hello there"], GREEDY)[0].prompt_token_ids
    )


# ---- the modeled P->D link ----------------------------------------------------------------
def test_a_modeled_transfer_delays_the_load_until_its_modeled_time(ray_session):
    clock, acks = FakeClock(), []
    consumer = RayKVConnector(
        "d0", "consumer", 4, ack_sender=lambda *ids: acks.append(ids), clock=clock
    )
    pool = np.zeros((8, 1, 2, 4, 1, 1), dtype=np.uint8)
    consumer.register_kv_caches(torch.from_numpy(pool))
    consumer.set_modeled_transfer(lambda num_tokens: 0.001 * num_tokens)  # 1 ms per token
    source = np.ones((2, 1, 2, 4, 1, 1), dtype=np.uint8)
    ref = ray.put([source])
    load = RayKVLoad("r1", "p0", "p-r1", ref, [(0, 0, 3, 2)], source.nbytes, 1, num_tokens=8)
    consumer.start_load_kv(RayKVConnectorMetadata([load]))
    ray.get(ref)  # the data itself is local at once
    assert until_done(load)
    clock.now += 0.0079
    assert consumer.get_finished(set()) == (set(), set()) and not acks
    clock.now += 0.0002
    assert consumer.get_finished(set()) == (set(), {"r1"})
    assert acks == [("p0", "p-r1", "")] and pool[3:5].all() and not pool[:3].any()


def until_done(load: RayKVLoad) -> bool:
    load.future.result(timeout=20)
    return load.future.done()


# ---- a sim cluster -------------------------------------------------------------------------
def test_sim_config_from_yaml(tmp_path):
    path = tmp_path / "sim.yaml"
    path.write_text(
        f"model: '{SIM_8B}'\nengine:\n  sim_time_scale: 4\nprefill: {{count: 1}}\n"
        "decode: {count: 1}\n"
    )
    config = ClusterConfig.load(path)
    engine = config.engine_config("decode", resolve_model_dir(config.model))
    assert engine.sim_time_scale == 4.0


@pytest.fixture(scope="module")
def reference_sim():
    llm = LLM(SIM_8B, **ENGINE)
    prompts = mixed_prompts(with_images=False)
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    "roles", [{"prefill": 1, "decode": 1}, {"mixed": 1}], ids=["1P1D", "1mixed"]
)
def test_sim_cluster_matches_colocated_token_for_token(ray_session, reference_sim, roles):
    prompts, expected = reference_sim
    with start(SIM_8B, **roles) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected
        assert_clean(cluster, baseline)  # every instance back to all blocks free
        stats = cluster.stats()
    assert all(s.sim.steps > 0 and s.kv_cache_bytes < 1 << 20 for s in stats)
    if "prefill" in roles:  # the KV really went P -> D through the connector
        assert sum(s.kv_transfer.num_loads for s in stats if s.role == "decode") == len(prompts)


def test_sim_cluster_aborts_while_decoding_and_cleans_up(ray_session):
    long = dataclasses.replace(GREEDY, max_tokens=400)
    with start(SIM_8B, prefill=1, decode=1) as cluster:
        baseline = live_object_ids()

        async def scenario():
            task = asyncio.create_task(collect(cluster, cluster.make_request("x " * 50, long)))
            assert await until(lambda: instance_stats(cluster, "decode").scheduler.num_running == 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(scenario())
        assert_clean(cluster, baseline)


def test_validation_table_marks_gaps_beyond_the_tolerance():
    def results(ttft_p50: float, goodput: float) -> dict:
        summary = {
            "ttft_ms": {"p50": ttft_p50, "p90": 200.0},
            "tpot_ms": {"p50": 50.0, "p90": 80.0},
            "attainment": 0.9,
        }
        run = {"rate_rps": 0.3, "summary": summary}
        topo = {"topology": "1P1D", "name": "x", "runs": [run]}
        return {"topologies": [topo | {"goodput": {"interpolated_rps": goodput}}]}

    rows = sim_validation.table(results(100.0, 0.30), results(130.0, 0.32)).splitlines()
    assert rows[2].startswith("| 1P1D | 0.3 | 100 / 130 (1.30 **✗**) | 200 / 200 (1.00) |")
    assert rows[-1] == "| 1P1D | 0.300 / 0.320 (1.07) |"
