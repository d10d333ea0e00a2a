"""The Ray Serve application (the RayService import path) serves the same API over HTTP."""

from __future__ import annotations

import httpx
import yaml

from tests.cluster_utils import SMALL_ENGINE
from tests.gateway_utils import free_port


def test_serve_app_answers_over_http(ray_session, preset_dir, tmp_path):
    from ray import serve

    from cluster.serve_app import build_app

    config = {
        "model": preset_dir("tiny-llava"),
        "engine": SMALL_ENGINE,
        "prefill": {"count": 1, "num_cpus": 1},
        "decode": {"count": 1, "num_cpus": 1},
        "gateway": {"served_model_name": "tiny"},
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"config": str(path)}), name="pdcluster", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
        assert stream.text.rstrip().endswith("data: [DONE]")
        instances = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instances"]
        assert sorted(i["role"] for i in instances) == ["decode", "prefill"]
    finally:
        serve.shutdown()
