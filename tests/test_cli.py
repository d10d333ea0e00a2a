"""`pdcluster` command line: serve flags, config errors, and `serve` as a real process
(embedded Ray, SIGTERM) — the Ray token-auth runs are in test_token_auth.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import pdcluster
from pdcluster.cluster.cli import build_parser, main
from pdcluster.cluster.serve_flags import load_serve_config
from tests.cli_utils import (
    complete,
    descendants,
    serve_command,
    serve_env,
    wait_for,
    wait_until_serving,
)
from tests.gateway_utils import free_port

SIGTERM_STOP_S = 10.0  # well inside the 30 s Kubernetes waits before its SIGKILL


def serve_config(*flags: str):
    return load_serve_config(build_parser().parse_args(["serve", *flags]))


# ---- flags -> config ---------------------------------------------------------------------


def test_role_flags_without_config_are_exactly_the_topology():
    config = serve_config("--model", "preset:tiny-llama", "--prefills", "2", "--decodes", "1")
    assert config.topology_name() == "2P1D"
    assert config.model == "preset:tiny-llama"
    assert serve_config("--mixed", "1").topology_name() == "1mixed"


def test_no_config_and_no_role_flags_is_one_prefill_and_one_decode():
    assert serve_config().topology_name() == "1P1D"


def test_flags_override_a_builtin_config_by_name():
    config = serve_config("--config", "local-1e1p1d", "--decodes", "2", "--num-blocks", "64")
    assert config.topology_name() == "1E1P2D"
    assert config.engine.num_blocks == 64
    assert config.model == "preset:tiny-llava"  # from the YAML


def test_gateway_and_ray_flags_land_in_their_sections():
    config = serve_config(
        "--mixed", "1", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
        "--address", "10.0.0.1:6379", "--max-model-len", "512",
    )  # fmt: skip
    assert (config.gateway.host, config.gateway.port, config.gateway.api_key) == (
        "0.0.0.0",
        9000,
        "k",
    )
    assert config.ray.address == "10.0.0.1:6379"
    assert config.engine_settings("mixed").max_model_len == 512


def test_tool_and_template_flags_land_in_the_gateway_section(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = serve_config(
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template",
        str(template), "--chat-template-content-format", "string",
    )  # fmt: skip
    gateway = config.gateway
    assert gateway.enable_auto_tool_choice and gateway.tool_call_parser == "hermes"
    assert gateway.chat_template == template.read_text()
    assert gateway.chat_template_content_format == "string"
    assert not serve_config("--mixed", "1").gateway.enable_auto_tool_choice


def test_migration_limit_flag_and_yaml_reach_the_router(tmp_path):
    from pdcluster.cluster.client import router_config
    from pdcluster.routing.policy import DEFAULT_MIGRATION_LIMIT

    assert serve_config().router.migration_limit == DEFAULT_MIGRATION_LIMIT == 3
    assert router_config(serve_config("--migration-limit", "0")).migration_limit == 0
    path = tmp_path / "t.yaml"
    path.write_text("mixed: {count: 1}\nrouter: {migration_limit: 5}\n")
    assert serve_config("--config", str(path)).router.migration_limit == 5
    with pytest.raises(ValueError, match="migration_limit"):
        serve_config("--migration-limit", "-1")


def test_speculative_config_flag_is_vllms_json_object(capsys):
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    config = serve_config("--decodes", "1", "--prefills", "1", "--speculative-config", flag)
    speculative = config.engine_config("decode", "/models/m").speculative
    assert (speculative.method, speculative.num_speculative_tokens) == ("ngram", 3)
    assert speculative.prompt_lookup_max == 4
    with pytest.raises(SystemExit):
        serve_config("--speculative-config", "{method: ngram}")
    assert "--speculative-config: not JSON" in capsys.readouterr().err
    code, err = run_main(capsys, "serve", "--speculative-config", '{"method": "eagle"}')
    assert code == 2 and "engine.speculative_config" in err and "'num_speculative_tokens'" in err


def test_lora_flags_are_vllms(capsys, tmp_path):
    json_module = '{"name": "chat", "path": "%s", "base_model_name": "m"}' % (tmp_path / "c")
    config = serve_config(
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules",
        f"sql={tmp_path / 's'}", json_module,
    )  # fmt: skip
    lora = config.engine_config("decode", "/models/m").lora
    assert (lora.max_loras, lora.max_lora_rank, lora.cpu_loras) == (3, 32, 3)
    adapters = config.lora.adapters()
    assert {n: a.path for n, a in adapters.items()} == {
        "sql": str(tmp_path / "s"), "chat": str(tmp_path / "c"),
    }  # fmt: skip
    with pytest.raises(SystemExit):
        serve_config("--enable-lora", "--lora-modules", "no-path")
    assert "name=path" in capsys.readouterr().err
    code, err = run_main(capsys, "serve", "--lora-modules", "sql=/a")
    assert code == 2 and "lora_modules need enable_lora" in err


def test_lora_must_be_the_same_on_every_role_that_runs_requests(capsys, tmp_path):
    config = tmp_path / "t.yaml"
    config.write_text("prefill: {count: 1}\ndecode: {count: 1, engine: {enable_lora: true}}\n")
    code, err = run_main(capsys, "serve", "--config", str(config))
    assert code == 2 and "must be the same for prefill, decode and mixed" in err


# ---- errors are one line, exit 2 -----------------------------------------------------------


def run_main(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_out_of_range_port_is_a_clear_error(capsys):
    code, err = run_main(capsys, "serve", "--model", "preset:tiny-llama", "--port", "99999")
    assert code == 2
    assert err == (
        "error: invalid config: gateway.port: Input should be less than or equal to 65535 "
        "(got 99999)\n"
    )


def test_bad_yaml_names_the_file_and_line(capsys, tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text("mixed:\n  count: 1\n   num_cpus: 1\n", encoding="utf-8")
    code, err = run_main(capsys, "serve", "--config", str(path))
    assert code == 2
    assert err.startswith(f"error: {path}:3:") and err.count("\n") == 1


def test_port_in_use_fails_before_anything_starts(capsys, monkeypatch):
    import pdcluster.cluster.serve as serve_module

    def launch(*_):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(serve_module, "launch", launch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, err = run_main(capsys, "serve", "--mixed", "1", "--port", str(port))
    assert code == 2
    assert err == f"error: port {port} on 127.0.0.1 is in use\n"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"pdcluster {pdcluster.__version__}\n"


def test_serve_help_shows_examples(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "pdcluster serve --model preset:tiny-llama --prefills 1 --decodes 1" in out
    assert "local-1p1d" in out


def test_facade_package_exports_the_public_api():
    from pdcluster.cluster.client import Cluster
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.control.launch import launch
    from pdcluster.engine import LLM, SamplingParams

    assert pdcluster.ClusterConfig is ClusterConfig and pdcluster.launch is launch
    assert pdcluster.Cluster is Cluster
    assert pdcluster.LLM is LLM and pdcluster.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        _ = pdcluster.nothing_here


# ---- serve as a process ------------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="finds Ray's processes in /proc")
def test_sigterm_stops_serve_and_its_embedded_ray(tmp_path):
    """What systemd and Kubernetes send, to the whole process group: the gateway, the
    instances and the embedded Ray (raylet, GCS) all go within SIGTERM_STOP_S, and the
    process exits 0. (Its KV pool is sized from memory, and startup says how big it came
    out.)"""
    port = free_port()
    env = serve_env(tmp_path, RAY_AUTH_MODE="disabled")
    command = serve_command(
        "--model", "preset:tiny-llama", "--mixed", "1", "--port", str(port),
        "--kv-cache-memory-fraction", "0.001",
    )  # fmt: skip
    process = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        starting = wait_until_serving(process, port)
        assert starting and starting[0]["status"] == "starting"  # answered while it started
        children = descendants(process.pid)
        names = {name for _, name in children}
        assert {"raylet", "gcs_server"} <= names, names
        complete(port)
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        _, log = process.communicate(timeout=SIGTERM_STOP_S)
        wait_for(
            lambda: not any(_running(pid) for pid, _ in children),
            "Ray processes left running",
            SIGTERM_STOP_S - (time.monotonic() - started),
        )
        print(f"stopped {time.monotonic() - started:.1f} s after SIGTERM")
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, log
    assert "serving 'tiny-llama' on http://127.0.0.1" in log and "stopped" in log
    assert "(1 gateway replica)" in log and "Scheduling a restartable detached actor" not in log
    ready = re.search(r"ready: KV cache (\d+) blocks x 16 tokens = \d+ tokens, ([\d.]+) GiB", log)
    assert ready and int(ready[1]) > 0 and 0 < float(ready[2]) < 0.001 * 1024, log


def _running(pid: int) -> bool:
    """Not yet exited (a zombie has exited: only its parent's reaping is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# ---- a newcomer's flags fit the machine ----------------------------------------------------


def test_flag_topology_with_more_instances_than_cores_gets_as_many_logical_cpus(monkeypatch):
    """An embedded Ray is sized so that the asked topology is placed (instances share the
    cores), as the built-in YAML configs do with ray.num_cpus; a topology that fits the cores
    or names its own ray.num_cpus is left alone."""
    from pdcluster.cluster.control.launch import sized_for_this_machine

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    sized = sized_for_this_machine(serve_config("--prefills", "2", "--decodes", "1"))
    assert sized.ray.num_cpus == 3
    assert sized_for_this_machine(serve_config("--mixed", "2")).ray.num_cpus is None
    local = sized_for_this_machine(serve_config("--config", "local-1e1p1d", "--decodes", "2"))
    assert local.ray.num_cpus == 4  # the YAML's own


@pytest.mark.skipif(sys.platform != "linux", reason="counts the cores with sched_getaffinity")
def test_serve_with_more_instances_than_cores_comes_up(tmp_path):
    """`serve --prefills <cores> --decodes 1` on an embedded Ray: more instances than cores,
    one CPU each, are placed and answer (before: PlacementTimeout after 300 s)."""
    port = free_port()
    prefills = len(os.sched_getaffinity(0))
    command = serve_command(
        "--model", "preset:tiny-llama", "--prefills", str(prefills), "--decodes", "1",
        "--port", str(port), "--num-blocks", "64",
    )  # fmt: skip
    env = serve_env(tmp_path, RAY_AUTH_MODE="disabled")
    process = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_until_serving(process, port)
        complete(port)
        os.killpg(process.pid, signal.SIGTERM)
        _, log = process.communicate(timeout=SIGTERM_STOP_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert f"{prefills}P1D reserves {prefills + 1} CPUs on {prefills} cores" in log, log


def test_a_topology_that_cannot_be_placed_fails_at_once_in_one_line(tmp_path):
    """A GPU asked of a machine's embedded Ray that has none: one line naming what the
    topology needs and what there is, exit 2, no traceback (the subprocess's timeout bounds
    the wait; measured ~26 s on 2 cores, against 300 s before)."""
    path = tmp_path / "gpu.yaml"
    path.write_text("model: preset:tiny-llama\nmixed: {count: 1, num_gpus: 1}\n")
    env = serve_env(tmp_path, RAY_AUTH_MODE="disabled", CUDA_VISIBLE_DEVICES="")
    command = serve_command("--config", str(path), "--port", str(free_port()))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert errors[0].startswith("error: 1mixed needs {'CPU': 1.0, 'GPU': 1.0}")
    assert "this machine's Ray has {'CPU': " in errors[0] and "'GPU': 0.0}" in errors[0]


def test_a_starting_server_answers_503_at_once_and_keeps_its_port():
    """While the cluster starts, the bound port answers every request with 503 "starting"
    and Retry-After (not a hang in the backlog); the socket then passes to the gateway."""
    from pdcluster.cluster.replicas import listen
    from pdcluster.cluster.serve import answering_starting

    with listen("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        with answering_starting(sock):
            for path in ("/health", "/v1/chat/completions"):
                response = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
                assert response.status_code == 503 and response.headers["retry-after"] == "5"
                assert response.json()["status"] == "starting"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = sock.accept()  # still listening, for the server that takes over
            accepted.close()
