"""The Ray Serve application (the RayService import path) serves the same API over HTTP;
its replicas share one instance pool."""

from __future__ import annotations

import httpx
import pytest
import yaml

from tests.cluster_utils import SMALL_ENGINE
from tests.gateway_utils import free_port

CONFIG = {
    "engine": SMALL_ENGINE,
    "prefill": {"count": 1, "num_cpus": 1},
    "decode": {"count": 1, "num_cpus": 1},
    "gateway": {"served_model_name": "tiny"},
}


# ~26 s each: the inline dict runs in -m slow (config parsing has unit tests)
@pytest.mark.parametrize(
    "inline", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["yaml-path", "inline-dict"]
)
def test_serve_app_replicas_share_one_pool(ray_session, preset_dir, tmp_path, inline):
    from ray import serve

    from pdcluster.cluster.control.launch import shutdown_pool
    from pdcluster.cluster.serve_app import build_app

    config = {**CONFIG, "model": preset_dir("tiny-llava")}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    pool = f"serve-test-{int(inline)}"
    args = {"config": config if inline else str(path), "pool": pool, "num_replicas": 2}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name="pdcluster", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
        for _ in range(4):  # spread over both replicas
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 5
        stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
        assert stream.text.rstrip().endswith("data: [DONE]")
        instances = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instances"]
        assert sorted(i["role"] for i in instances) == ["decode", "prefill"]  # one pool
    finally:
        serve.shutdown()
        assert shutdown_pool(pool)  # a detached pool outlives the app until ended
    assert not shutdown_pool(pool)


def test_build_app_rejects_unknown_args():
    from pdcluster.cluster.serve_app import build_app

    with pytest.raises(ValueError, match="unknown build_app args: \\['replicas'\\]"):
        build_app({"replicas": 2})
