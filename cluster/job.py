"""Batch inference through a pdcluster: JSONL prompts in, JSONL results out.

    python -m pdcluster.cluster.job --config CONFIG --input prompts.jsonl --output results.jsonl

Each input line is an object with an `id` (string or integer, unique in the file) and one of
`prompt` (text), `messages` (OpenAI chat messages, rendered with the model's chat template;
images as `image_url` parts with `data:` URLs) or `prompt_token_ids`, plus optional sampling
fields. Each result is one line, written and flushed as its request finishes:
`{"id", "text", "token_ids", "finish_reason", "num_prompt_tokens"}`, with `"error"` added
when finish_reason is "error". A bad input line gets such an error line; the job goes on.

Rerunning with the same output file skips every id already in it, so a job that stopped
part way resumes where it left off. Under `ray job submit` the job joins the job's cluster
(Ray sets RAY_ADDRESS); give input and output as absolute paths there, since the job runs
in a copy of the working directory.

Exit status: 0 when the job ran (even with per-line errors), 2 on a config or I/O error,
1 when the cluster failed to start, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.job_io import JobItem, ResultWriter, read_done_ids, read_items, result_line
from pdcluster.engine.llm import merge_output, new_request_output
from pdcluster.engine.processor import PromptType
from pdcluster.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdcluster.cluster.client import Cluster

# ---- running ------------------------------------------------------------------------------


def to_prompt(cluster: Cluster, item: JobItem) -> PromptType:
    """The engine prompt of an item; chat messages are rendered with the chat template."""
    if item.prompt_key != "messages":
        return item.prompt
    images = [_image_bytes(part) for part in _image_parts(item.prompt)]
    token_ids = cluster.tokenizer.encode_chat(item.prompt)
    if not images:
        return token_ids
    return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}}


def _image_parts(messages: list[Any]) -> Iterator[dict[str, Any]]:
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise ValueError("each content part must be an object with a 'type'")
                if part.get("type") in ("image_url", "input_image", "image"):
                    yield part


def _image_bytes(part: dict[str, Any]) -> bytes:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ValueError("images in a batch job must be data: URLs with base64 content")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"invalid base64 image data: {exc}") from exc


async def run_one(cluster: Cluster, item: JobItem) -> dict[str, Any]:
    """Generate one item through the cluster; every failure becomes an error line."""
    if item.error is not None:
        return result_line(item, error=item.error)
    try:
        if item.priority and not cluster.priority_scheduling:
            raise ValueError(
                f"'priority' {item.priority} needs the engine's scheduling_policy 'priority'"
            )
        prompt = to_prompt(cluster, item)
        request = cluster.make_request(prompt, item.params, None, item.cache_salt, item.priority)
    except (TypeError, ValueError) as exc:
        return result_line(item, error=str(exc))
    result = new_request_output(request)
    try:
        async for out in cluster.stream(request):
            merge_output(result, out)
    except Exception as exc:  # the cluster failed this request (e.g. an actor died)
        return result_line(item, error=f"{type(exc).__name__}: {exc}")
    completion = result.outputs[0]
    return result_line(
        item,
        text=completion.text,
        token_ids=completion.token_ids,
        finish_reason=completion.finish_reason or "error",
        num_prompt_tokens=len(request.prompt_token_ids),
        error=completion.error,
    )


async def run_items(
    cluster: Cluster,
    items: list[JobItem],
    writer: ResultWriter,
    concurrency: int,
    progress: tqdm,
) -> None:
    """Run `items` with at most `concurrency` requests in flight, writing each as it ends."""
    limit = asyncio.Semaphore(concurrency)

    async def one(item: JobItem) -> None:
        async with limit:
            writer.write(await run_one(cluster, item))
            progress.update(1)

    pending = iter(items)
    tasks: set[asyncio.Task] = set()
    try:
        while True:  # hold at most 2 * concurrency tasks, not one per line of a huge file
            for item in pending:
                tasks.add(asyncio.create_task(one(item)))
                if len(tasks) >= 2 * concurrency:
                    break
            if not tasks:
                return
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClusterStartError(RuntimeError):
    """launch() failed: the job did not run."""


# ---- command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdcluster.cluster.job",
        description="Batch inference through a pdcluster: JSONL prompts in, JSONL results out.",
    )
    parser.add_argument("--config", required=True, help="topology config (YAML)")
    parser.add_argument("--input", required=True, help="prompts, one JSON object a line")
    parser.add_argument("--output", required=True, help="results (appended; done ids skipped)")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join, e.g. 'auto' or host:port (default: config's ray.address, "
        "else RAY_ADDRESS as set by `ray job submit`, else an embedded local Ray)",
    )
    parser.add_argument("--concurrency", type=_positive_int, default=64, help="requests in flight")
    parser.add_argument("--max-tokens", type=_positive_int, default=256, help="default per line")
    parser.add_argument("--temperature", type=float, default=0.0, help="default per line")
    parser.add_argument(
        "--retry-errors", action="store_true", help="rerun ids whose output line is an error"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def load_config(path: str, address: str | None) -> ClusterConfig:
    """The topology config, joined to `address` when given (else the config's address, else
    RAY_ADDRESS as `ray job submit` sets it: see actors/ray_runtime.py)."""
    config = ClusterConfig.from_yaml(path)
    if not address:
        return config
    return config.model_copy(update={"ray": config.ray.model_copy(update={"address": address})})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        SamplingParams(**defaults)
        config = load_config(args.config, args.address)
        with open(args.input, encoding="utf-8") as f:
            items, num_dropped = read_items(f, defaults, sys.stderr)
        output = Path(args.output)
        done = read_done_ids(output, args.retry_errors)
        writer = ResultWriter(output)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    todo = [item for item in items if item.item_id not in done]
    try:
        if todo:
            _run_job(config, todo, writer, args, initial=len(items) - len(todo))
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except ClusterStartError as exc:
        print(f"error: the cluster did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        writer.close()
    print(
        f"{writer.num_written} written ({writer.num_errors} errors), "
        f"{len(items) - len(todo)} already done, {num_dropped} input lines dropped -> {output}",
        file=sys.stderr,
    )
    return 0


def _run_job(
    config: ClusterConfig, todo: list[JobItem], writer: ResultWriter, args, initial: int
) -> None:
    from pdcluster.actors.ray_runtime import gcs_address  # Ray only once there is work to do
    from pdcluster.cluster.control.launch import launch

    try:
        cluster = launch(config)
    except Exception as exc:  # Ray unreachable, resources missing, a model that fails to load
        raise ClusterStartError(f"{type(exc).__name__}: {exc}") from exc
    print(
        f"pdcluster {config.topology_name()} is up on the Ray cluster at "
        f"{gcs_address()}; {len(todo)} requests to run",
        file=sys.stderr,
    )
    progress = tqdm(
        total=initial + len(todo),
        initial=initial,
        desc="job",
        unit="req",
        file=sys.stderr,
        disable=args.no_progress,
        mininterval=0.1 if sys.stderr.isatty() else 5.0,
    )
    try:
        asyncio.run(run_items(cluster, todo, writer, args.concurrency, progress))
    finally:
        progress.close()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
