"""The batch job's JSONL files (format: cluster/job.py). Input lines become `JobItem`s, a bad
line an item carrying its error (or, with no usable id, a warning); results are appended one
line per finished request, and a rerun reads them back to skip the ids already done."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pdcluster.engine.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
INT_FIELDS = ("max_tokens", "top_k", "seed", "min_tokens")
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
LIST_FIELDS = ("stop", "stop_token_ids")
SAMPLING_FIELDS = (*INT_FIELDS, *FLOAT_FIELDS, *BOOL_FIELDS, *LIST_FIELDS)
REQUEST_FIELDS = ("cache_salt", "priority")  # vLLM's, as on the HTTP API
INPUT_KEYS = frozenset(("id", *PROMPT_KEYS, *SAMPLING_FIELDS, *REQUEST_FIELDS))

ItemId = str | int


@dataclass
class JobItem:
    """One input line: a prompt and its sampling parameters, or why it is invalid."""

    line_no: int
    item_id: ItemId
    prompt_key: str = ""
    prompt: Any = None
    params: SamplingParams | None = None
    cache_salt: str | None = None
    priority: int = 0
    error: str | None = None


# ---- input --------------------------------------------------------------------------------


def parse_line(line_no: int, text: str, defaults: dict[str, Any]) -> JobItem | str:
    """A `JobItem` (possibly carrying an error), or a message when the line has no usable id."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(data, dict):
        return f"line {line_no}: expected a JSON object, got {type(data).__name__}"
    item_id = data.get("id")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
        return f"line {line_no}: 'id' is required (a non-empty string or an integer)"
    item = JobItem(line_no, item_id)
    try:
        item.prompt_key, item.prompt = _prompt_field(data)
        item.params = _sampling_params(data, defaults)
        item.cache_salt, item.priority = _request_fields(data)
    except (TypeError, ValueError) as exc:
        item.error = str(exc)
    return item


def _prompt_field(data: dict[str, Any]) -> tuple[str, Any]:
    unknown = sorted(set(data) - INPUT_KEYS)
    if unknown:
        raise ValueError(f"unknown fields {unknown}; allowed: {sorted(INPUT_KEYS)}")
    present = [k for k in PROMPT_KEYS if k in data]
    if len(present) != 1:
        raise ValueError("a line needs exactly one of 'prompt', 'messages', 'prompt_token_ids'")
    key = present[0]
    value = data[key]
    if key == "prompt" and not isinstance(value, str):
        raise ValueError("'prompt' must be a string")
    if key == "messages" and (not isinstance(value, list) or not value):
        raise ValueError("'messages' must be a non-empty list of chat messages")
    if key == "prompt_token_ids" and not isinstance(value, list):
        raise ValueError("'prompt_token_ids' must be a list of integers")
    return key, value


def _sampling_params(data: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    fields = {k: data[k] for k in SAMPLING_FIELDS if k in data}
    for key, value in fields.items():
        _check_type(key, value)
    return SamplingParams(**{**defaults, **fields})


def _request_fields(data: dict[str, Any]) -> tuple[str | None, int]:
    """The line's cache_salt (a non-empty string) and priority (an integer)."""
    salt, priority = data.get("cache_salt"), data.get("priority", 0)
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"'cache_salt' must be a non-empty string, got {json.dumps(salt)}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"'priority' must be an integer, got {json.dumps(priority)}")
    return salt, priority


def _check_type(key: str, value: Any) -> None:
    if key in INT_FIELDS:
        ok = value is None if key == "seed" else False
        ok = ok or (isinstance(value, int) and not isinstance(value, bool))
        expected = "an integer"
    elif key in FLOAT_FIELDS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
    elif key in BOOL_FIELDS:
        ok, expected = isinstance(value, bool), "true or false"
    elif key == "stop":
        ok = isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value)
        )
        expected = "a string or a list of strings"
    else:
        ok = isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        )
        expected = "a list of integers"
    if not ok:
        raise ValueError(f"'{key}' must be {expected}, got {json.dumps(value)}")


def read_items(
    lines: Iterable[str], defaults: dict[str, Any], warn: IO[str]
) -> tuple[list[JobItem], int]:
    """Parse every non-blank line; returns the items and how many lines were dropped
    (no usable id, or a repeated id), each dropped line reported on `warn`."""
    items: list[JobItem] = []
    first_line: dict[ItemId, int] = {}
    num_dropped = 0
    for line_no, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        item = parse_line(line_no, text, defaults)
        if isinstance(item, JobItem) and item.item_id in first_line:
            item = (
                f"line {line_no}: duplicate id {json.dumps(item.item_id)} "
                f"(first on line {first_line[item.item_id]}); line skipped"
            )
        if isinstance(item, str):
            print(f"warning: {item}", file=warn)
            num_dropped += 1
            continue
        first_line[item.item_id] = line_no
        items.append(item)
    return items, num_dropped


# ---- output -------------------------------------------------------------------------------


def read_done_ids(path: Path, retry_errors: bool = False) -> set[ItemId]:
    """Ids already written to `path`. A partly written last line (a crash mid-write) is cut
    off; with `retry_errors`, error lines are removed so that those ids run again."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if _parse_result(data[len(complete) :]):  # a whole last line, only its newline missing
        complete = data + b"\n"
    lines = complete.splitlines(keepends=True)
    kept: list[bytes] = []
    done: set[ItemId] = set()
    for raw in lines:
        result = _parse_result(raw)
        if result is None:
            continue  # an unreadable line: its id, if any, runs again
        if retry_errors and result.get("finish_reason") == "error":
            continue
        kept.append(raw)
        done.add(result["id"])
    if complete != data or (retry_errors and len(kept) != len(lines)):
        _replace(path, b"".join(kept) if retry_errors else complete)
    return done


def _parse_result(raw: bytes) -> dict[str, Any] | None:
    try:
        result = json.loads(raw)
    except ValueError:
        return None
    return result if isinstance(result, dict) and "id" in result else None


def _replace(path: Path, content: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def result_line(item: JobItem, **fields: Any) -> dict[str, Any]:
    line = {
        "id": item.item_id,
        "text": fields.get("text", ""),
        "token_ids": fields.get("token_ids", []),
        "finish_reason": fields.get("finish_reason", "error"),
        "num_prompt_tokens": fields.get("num_prompt_tokens", 0),
    }
    if fields.get("error") is not None or line["finish_reason"] == "error":
        line["error"] = fields.get("error") or "request failed"
    return line


class ResultWriter:
    """Appends one JSON line per result and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self.num_written = 0
        self.num_errors = 0

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._file.flush()
        self.num_written += 1
        self.num_errors += line["finish_reason"] == "error"

    def close(self) -> None:
        self._file.close()
