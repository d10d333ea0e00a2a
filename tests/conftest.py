"""Shared fixtures. Ray starts at most once per test session, and only for tests that ask."""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local clusters in tests
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The session's Ray workers inherit it: instances accept the fault-injection suite's faults
# (connectors/faults.py; a test arms them, and nothing else does).
os.environ.setdefault("PDCLUSTER_FAULT_INJECTION", "1")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (starting Ray costs seconds)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # always a fresh cluster, never one another process started
            namespace="pdcluster",  # pools are named (detached) actors: give them a home
            num_cpus=8,
            include_dashboard=False,
            object_store_memory=512 * 1024 * 1024,
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def preset_dir(tmp_path_factory):
    """Factory: the folder of a built-in preset checkpoint, written once per session."""
    from pdcluster.engine.presets import make_model

    made: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in made:
            made[preset] = str(make_model(preset, tmp_path_factory.mktemp(preset)))
        return made[preset]

    return get


@pytest.fixture(scope="module")
def model_dir(preset_dir):
    """The multimodal preset the cluster tests serve."""
    return preset_dir("tiny-llava")


@pytest.fixture(scope="session")
def tools_model_dir(preset_dir, tmp_path_factory):
    """tiny-llama with a chat template that renders tools (Hermes-style calls, as tiny-qwen2's)."""
    from pdcluster.engine.preset_tokenizer import chat_template

    folder = tmp_path_factory.mktemp("tiny-llama-tools") / "model"
    shutil.copytree(preset_dir("tiny-llama"), folder)
    (folder / "chat_template.jinja").write_text(chat_template(False, True, tools=True))
    return str(folder)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Colocated, in-process greedy outputs: what every topology must reproduce."""
    from pdcluster.engine import LLM
    from tests.cluster_utils import GREEDY, SMALL_ENGINE

    llm = LLM(model_dir, **SMALL_ENGINE)
    return lambda prompt, params=GREEDY: llm.generate(prompt, params)[0]


@pytest.fixture
def clean(cluster):
    """After the test: every instance of the module's `cluster` idle with all its blocks
    free, and nothing the test created left in the object store."""
    from tests.cluster_utils import assert_clean, live_object_ids

    baseline = live_object_ids()
    yield
    assert_clean(cluster, baseline)


@pytest.fixture(scope="module")
def base_url(cluster):
    """The module's `cluster` (each gateway test module defines one) served over HTTP on a
    loopback port."""
    from pdcluster.cluster.replicas import gateway_app
    from tests.gateway_utils import running

    with running(gateway_app(cluster)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    """An unmodified openai client on `base_url`."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
