"""Multi-LoRA on a cluster, as a vLLM client uses it: adapters served from the start and
loaded at run time through vLLM's endpoints, chosen by the request's `model`, listed in
/v1/models; on P/D and colocated, greedy outputs are transformers + peft's for a batch mixing
the base model and two adapters, and a prompt served under one adapter never reuses another's
blocks (prefix cache or cluster KV pool). A folder that cannot be served is a 400 that
changes nothing anywhere; loads and unloads under load fail no stream."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import httpx
import pytest

from pdcluster.engine import SamplingParams
from tests.cluster_utils import (
    assert_clean,
    cluster_config,
    live_object_ids,
    stats_by_id,
    wait_until,
)
from tests.lora_utils import (
    ALL_PROJECTIONS,
    adapter_of_another_base,
    make_adapter,
    make_adapters,
)
from tests.test_engine_vs_transformers import hf_greedy

pytest.importorskip("peft")

NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def lora_model(preset_dir, tmp_path_factory):
    """(base folder, adapters folder, name -> peft reference), tiny-llama and its adapters."""
    base = preset_dir("tiny-llama")
    folder = tmp_path_factory.mktemp("cluster-lora")
    return base, folder, make_adapters(base, folder)


def lora_engine(folder, modules=("alpha", "beta"), max_loras: int = 2) -> dict:
    """Two adapters from the start; a third and more may be loaded (max_cpu_loras 4)."""
    return {
        "enable_lora": True, "max_loras": max_loras, "max_lora_rank": 8, "max_cpu_loras": 4,
        "lora_modules": {name: str(folder / name) for name in modules},
    }  # fmt: skip


def started(base: str, folder, **roles):
    config = cluster_config(base, **roles)
    engine = {**config.engine.model_dump(), **lora_engine(folder)}
    return type(config).model_validate({**config.model_dump(), "engine": engine})


@pytest.fixture(scope="module")
def cluster(ray_session, lora_model):
    from pdcluster.cluster.control.launch import launch

    base, folder, _ = lora_model
    with launch(started(base, folder, prefill=1, decode=1)) as cluster:
        yield cluster


def test_colocated_matches_peft_for_a_batch_of_base_and_two_adapters(ray_session, lora_model):
    from pdcluster.cluster.control.launch import launch

    base, folder, refs = lora_model
    with launch(started(base, folder, mixed=1)) as cluster:
        baseline = live_object_ids()
        _check_mixed_batch(cluster, refs)
        assert_clean(cluster, baseline)


def test_1p1d_matches_peft_for_a_batch_of_base_and_two_adapters(cluster, lora_model, clean):
    _check_mixed_batch(cluster, lora_model[2])


def _check_mixed_batch(cluster, refs) -> None:
    names = [None, "alpha", "beta"] * 2
    prompts = [PROMPTS[i % 2] for i in range(len(names))]

    async def run():
        calls = []
        for name, prompt in zip(names, prompts):
            lora = None if name is None else cluster.adapters[name]
            calls.append(cluster.generate_async([prompt], GREEDY, lora))
        return [outs[0] for outs in await asyncio.gather(*calls)]

    for name, prompt, out in zip(names, prompts, asyncio.run(run())):
        assert out.token_ids == hf_greedy(refs[name], prompt, NUM_NEW), name


def test_one_prompt_under_each_adapter_never_reuses_anothers_blocks(cluster, lora_model, clean):
    """The same long prompt in turn on the base model and each adapter, twice: each time
    peft's tokens, so no request read KV computed under another (P's prefix cache, D's, and
    the cluster KV pool all hold the prompt by then)."""
    refs = lora_model[2]
    prompt = list(range(100, 164))
    for name in [None, "alpha", "beta", "alpha", None, "beta"]:
        lora = None if name is None else cluster.adapters[name]
        out = cluster.generate([prompt], GREEDY, lora)[0]
        assert out.token_ids == hf_greedy(refs[name], prompt, NUM_NEW), name


def test_models_lists_each_adapter_with_the_base_model_as_parent(client, cluster, clean):
    cards = {m.id: m for m in client.models.list().data}
    base = cluster.model_name
    assert set(cards) == {base, "alpha", "beta"}
    assert cards["alpha"].parent == base and cards["alpha"].root.endswith("/alpha")
    assert cards[base].parent is None
    assert client.models.retrieve("beta").parent == base


def test_a_request_names_its_adapter_as_model(client, cluster, lora_model, clean):
    refs = lora_model[2]
    tokenizer = cluster.tokenizer
    for name in ("alpha", "beta", cluster.model_name):
        out = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=NUM_NEW, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        ref = refs[None if name == cluster.model_name else name]
        expected = hf_greedy(ref, PROMPTS[0], NUM_NEW)
        assert out.model == name
        assert out.choices[0].text == tokenizer.decode(expected)


def test_an_unknown_model_is_a_404(base_url, clean):
    body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{base_url}/v1/completions", json=body)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "model" and "'alpha'" in error["message"]
    assert httpx.get(f"{base_url}/v1/models/nope").status_code == 404


def _loaded(cluster) -> dict[str, tuple[str, ...]]:
    return {iid: s.lora.served for iid, s in stats_by_id(cluster).items()}


@pytest.mark.parametrize("case", ["missing_file", "not_a_folder", "wrong_base", "rank_16"])
def test_a_bad_adapter_folder_is_a_400_that_changes_nothing(
    base_url, cluster, lora_model, tmp_path, case, clean
):
    _, folder, _ = lora_model
    if case == "missing_file":
        path = tmp_path / "bad"
        shutil.copytree(folder / "alpha", path)
        (path / "adapter_model.safetensors").unlink()
    elif case == "not_a_folder":
        path = tmp_path / "nowhere"
    elif case == "rank_16":  # over the cluster's max_lora_rank 8
        path = tmp_path / "big"
        make_adapter(lora_model[2][None], path, 9, 16, 16, ALL_PROJECTIONS, False)
    else:
        path = adapter_of_another_base(tmp_path / "other")
    wait_until(lambda: all(s.is_idle() for s in cluster.stats()))
    before = _loaded(cluster)
    r = httpx.post(
        f"{base_url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)}
    )
    assert r.status_code == 400, r.text
    why = {
        "missing_file": "no adapter_model.safetensors", "not_a_folder": "no adapter_config.json",
        "wrong_base": "do not fit the base model", "rank_16": "exceeds max_lora_rank 8",
    }  # fmt: skip
    assert why[case] in r.json()["error"]["message"]
    assert _loaded(cluster) == before
    assert "bad" not in cluster.adapters


def test_load_use_and_unload_at_run_time_while_32_streams_run(base_url, cluster, lora_model, clean):
    """vLLM's endpoints: an adapter loaded while 32 streams (base and adapters) run serves
    peft's tokens on every instance, a D that joins later included; unloaded while its own
    requests run, they finish and new ones are a 404."""
    _, folder, refs = lora_model
    long = dataclasses.replace(GREEDY, max_tokens=48)
    names = [None, "alpha", "beta", None] * 8

    async def streams() -> list:
        calls = [
            cluster.generate_async([PROMPTS[i % 2]], long, name and cluster.adapters[name])
            for i, name in enumerate(names)
        ]
        return await asyncio.gather(*calls)

    async def load_and_stream() -> tuple[list, httpx.Response]:
        running = asyncio.ensure_future(streams())
        await asyncio.sleep(0)  # the streams are planned before the load is asked for
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"lora_name": "gamma", "lora_path": str(folder / "gamma")}
            loaded = await http.post(f"{base_url}/v1/load_lora_adapter", json=body)
        return await running, loaded

    outs, loaded = asyncio.run(load_and_stream())
    assert loaded.status_code == 200, loaded.text
    assert all(o[0].finish_reason == "length" and len(o[0].token_ids) == 48 for o in outs)
    assert wait_until(lambda: all("gamma" in s.lora.served for s in cluster.stats()))
    out = cluster.generate([PROMPTS[1]], GREEDY, cluster.adapters["gamma"])[0]
    assert out.token_ids == hf_greedy(refs["gamma"], PROMPTS[1], NUM_NEW)

    asyncio.run(cluster.scale("decode", 2))  # a new D serves every adapter from its start
    assert wait_until(lambda: all("gamma" in s.lora.served for s in cluster.stats()))
    asyncio.run(cluster.scale("decode", 1))

    async def unload_while_running() -> tuple[list, httpx.Response]:
        lora = cluster.adapters["gamma"]
        running = asyncio.ensure_future(
            asyncio.gather(*(cluster.generate_async([p], long, lora) for p in PROMPTS))
        )
        await asyncio.sleep(0)
        async with httpx.AsyncClient(timeout=60) as http:
            gone = await http.post(
                f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}
            )
        return await running, gone

    outs, gone = asyncio.run(unload_while_running())
    assert gone.status_code == 200, gone.text
    assert [len(o[0].token_ids) for o in outs] == [48, 48]
    body = {"model": "gamma", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{base_url}/v1/completions", json=body).status_code == 404
    again = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert again.status_code == 404
    assert wait_until(lambda: all("gamma" not in s.lora.served for s in cluster.stats()))
