"""The batch job: JSONL in, JSONL out, token-identical to the offline engine, resumable,
bad lines reported per line; in process and end to end under `ray job submit`."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from pdcluster.cluster import job, job_io
from pdcluster.engine import LLM, SamplingParams
from tests.cluster_utils import SMALL_ENGINE, random_image

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 6


def write_config(path: Path, model_dir: str) -> Path:
    data = {
        "model": model_dir,
        "engine": SMALL_ENGINE,
        "prefill": {"count": 1, "num_cpus": 1},
        "decode": {"count": 1, "num_cpus": 1},
    }
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def write_jsonl(path: Path, lines: list) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    random_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


CHAT = [{"role": "user", "content": "Tell me a story."}]
CHAT_IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in "},
            {"type": "image_url", "image_url": {"url": image_url(1)}},
            {"type": "text", "text": "?"},
        ],
    }
]
FIRST = [
    {"id": "text", "prompt": "Hello there, how are you today?", "ignore_eos": True},
    {"id": 7, "prompt_token_ids": [5, 9, 300, 41, 7], "ignore_eos": True},
    {"id": "chat", "messages": CHAT, "ignore_eos": True, "max_tokens": 3},
    {"id": "chat-image", "messages": CHAT_IMAGE, "ignore_eos": True},
]
SECOND = [
    {"id": "more", "prompt": "The quick brown fox " * 5, "ignore_eos": True},
    {"id": "bad-temp", "prompt": "x", "temperature": -1},
    {"id": "bad-field", "prompt": "x", "max_token": 5},
    {"id": "bad-type", "prompt": "x", "ignore_eos": "yes"},
    {"id": "no-prompt"},
    {"id": "too-long", "prompt_token_ids": [5] * 600},
    "{not json",
    {"prompt": "no id"},
    {"id": "text", "prompt": "a duplicate id"},
]


def reference(llm: LLM, line: dict) -> list[int]:
    """Greedy token ids of one input line from the offline engine."""
    if "messages" in line:
        prompt: object = llm.tokenizer.encode_chat(line["messages"])
        if line is FIRST[3]:
            prompt = {"prompt_token_ids": prompt, "multi_modal_data": {"image": random_image(1)}}
    else:
        prompt = line.get("prompt", line.get("prompt_token_ids"))
    params = SamplingParams(
        temperature=0.0, max_tokens=line.get("max_tokens", MAX_TOKENS), ignore_eos=True
    )
    return llm.generate(prompt, params)[0].token_ids


# ---- parsing and the output file, no Ray -------------------------------------------------


def test_bad_lines_become_errors_or_warnings():
    lines = [json.dumps(x) if not isinstance(x, str) else x for x in FIRST + SECOND]
    warnings = io.StringIO()
    items, num_dropped = job_io.read_items(lines, {"max_tokens": MAX_TOKENS}, warnings)
    by_id = {item.item_id: item for item in items}
    assert num_dropped == 3  # invalid JSON, no id, duplicate id
    for expected in ("line 11: invalid JSON", "line 12: 'id' is required", "line 13: duplicate"):
        assert expected in warnings.getvalue()
    assert "temperature" in by_id["bad-temp"].error
    assert "max_token" in by_id["bad-field"].error
    assert "'ignore_eos' must be true or false" in by_id["bad-type"].error
    assert "exactly one of" in by_id["no-prompt"].error
    assert by_id["text"].error is None and by_id["text"].prompt.startswith("Hello")
    assert by_id["chat"].params.max_tokens == 3 and by_id[7].params.max_tokens == MAX_TOKENS


def test_lines_carry_a_cache_salt_and_a_priority():
    lines = [
        {"id": "a", "prompt": "x", "cache_salt": "tenant-a", "priority": -2},
        {"id": "b", "prompt": "x"},
        {"id": "c", "prompt": "x", "cache_salt": ""},
        {"id": "d", "prompt": "x", "priority": 1.5},
    ]
    items, _ = job_io.read_items([json.dumps(x) for x in lines], {}, io.StringIO())
    by_id = {item.item_id: item for item in items}
    assert (by_id["a"].cache_salt, by_id["a"].priority) == ("tenant-a", -2)
    assert (by_id["b"].cache_salt, by_id["b"].priority) == (None, 0)
    assert "'cache_salt' must be a non-empty string" in by_id["c"].error
    assert "'priority' must be an integer" in by_id["d"].error


def test_done_ids_tolerate_a_partial_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [
        {"id": "a", "text": "x", "token_ids": [1], "finish_reason": "length"},
        {"id": 2, "text": "", "token_ids": [], "finish_reason": "error", "error": "boom"},
    ]
    write_jsonl(out, good)
    with out.open("a") as f:
        f.write('{"id": "half", "te')
    assert job_io.read_done_ids(out) == {"a", 2}
    assert read_results(out) == good  # the partial line is gone, so appends stay valid
    assert job_io.read_done_ids(out, retry_errors=True) == {"a"}
    assert read_results(out) == good[:1]
    with out.open("a") as f:  # a whole line, only its newline missing: kept
        f.write(json.dumps(good[1]))
    assert job_io.read_done_ids(out) == {"a", 2}
    assert out.read_text().endswith("\n") and read_results(out) == good


def test_config_and_io_errors_exit_2(tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", "preset:tiny-llava")
    out = str(tmp_path / "out.jsonl")
    assert job.main(["--config", str(config), "--input", "/no/such.jsonl", "--output", out]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: {count: 1}\nbogus: 1\n")
    inp = str(write_jsonl(tmp_path / "in.jsonl", FIRST))
    assert job.main(["--config", str(bad), "--input", inp, "--output", out]) == 2
    assert "bogus" in capsys.readouterr().err


# ---- in process, on the session's Ray --------------------------------------------------------


def test_job_matches_engine_resumes_and_reports_bad_lines(
    ray_session, preset_dir, tmp_path, monkeypatch
):
    model_dir = preset_dir("tiny-llava")
    config = write_config(tmp_path / "cluster.yaml", model_dir)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ["--config", str(config), "--input", str(inp), "--output", str(out)]
    args += ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--concurrency", "2"]

    write_jsonl(inp, FIRST)
    assert job.main(args) == 0
    first = read_results(out)
    assert sorted(map(str, (r["id"] for r in first))) == sorted(str(x["id"]) for x in FIRST)

    with out.open("a") as f:  # a crash mid-write leaves half a line
        f.write('{"id": "more", "text": "par')
    write_jsonl(inp, FIRST + SECOND)
    assert job.main(args) == 0
    results = read_results(out)
    assert results[: len(first)] == first  # done ids were skipped, not rerun
    by_id = {r["id"]: r for r in results}
    assert len(by_id) == len(results) == len(FIRST) + 6  # one line per id, no duplicates

    llm = LLM(model_dir, **SMALL_ENGINE)
    for line in [*FIRST, SECOND[0]]:
        result = by_id[line["id"]]
        assert result["finish_reason"] == "length" and "error" not in result
        assert result["token_ids"] == reference(llm, line), line["id"]
        assert result["text"] == llm.tokenizer.decode(result["token_ids"])
    assert by_id["chat-image"]["num_prompt_tokens"] > by_id["chat"]["num_prompt_tokens"]
    for bad in ("bad-temp", "bad-field", "bad-type", "no-prompt", "too-long"):
        assert by_id[bad]["finish_reason"] == "error" and by_id[bad]["error"], by_id[bad]
        assert by_id[bad]["token_ids"] == []
    assert "600 tokens" in by_id["too-long"]["error"]

    def no_launch(config):
        raise AssertionError("nothing left to do: no cluster should start")

    monkeypatch.setattr("pdcluster.cluster.control.launch.launch", no_launch)
    assert job.main(args) == 0
    assert read_results(out) == results


# ---- end to end: `ray job submit` to a separate local Ray cluster --------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_dashboard(url: str, head: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start exited early"
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no Ray dashboard at {url}")


def stop_cluster(head: subprocess.Popen) -> None:
    """Stop only the cluster this test started. (`ray stop` would stop every Ray on the
    machine, the test session's included.) `ray start --block` cleans up its processes
    on SIGTERM; anything left in its process group is then killed."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=10)


def test_ray_job_submit_end_to_end(preset_dir, tmp_path):
    model_dir = preset_dir("tiny-llava")
    config = write_config(tmp_path / "cluster.yaml", model_dir)
    inp = write_jsonl(tmp_path / "in.jsonl", FIRST[:2])
    out = tmp_path / "out.jsonl"
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    gcs_port, dashboard_port = free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    temp_dir = tempfile.mkdtemp(prefix="pdc-ray-")  # short: Ray's socket paths must fit
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=4"]
        + ["--node-ip-address=127.0.0.1", "--include-dashboard=true"]
        + ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        + [
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]
        + [f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, so that only it is stopped
    )
    try:
        wait_for_dashboard(dashboard, head)
        entrypoint = [sys.executable, "-m", "pdcluster.cluster.job", "--config", str(config)]
        entrypoint += ["--input", str(inp), "--output", str(out)]
        entrypoint += ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--no-progress"]
        submit = subprocess.run(
            [ray_bin, "job", "submit", "--address", dashboard, "--working-dir", str(REPO_ROOT)]
            + ["--", *entrypoint],  # .venv and .git are never uploaded (.gitignore, defaults)
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        logs = submit.stdout[-4000:] + submit.stderr[-4000:]
        assert submit.returncode == 0, logs
        assert "succeeded" in submit.stdout, logs
        # The job joined this cluster (RAY_ADDRESS) rather than starting an embedded Ray.
        assert f":{gcs_port}; 2 requests to run" in submit.stdout, logs
    finally:
        stop_cluster(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
    llm = LLM(model_dir, **SMALL_ENGINE)
    by_id = {r["id"]: r for r in read_results(out)}
    assert set(by_id) == {line["id"] for line in FIRST[:2]}
    for line in FIRST[:2]:
        assert by_id[line["id"]]["token_ids"] == reference(llm, line)
