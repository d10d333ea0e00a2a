"""Tokenizer of a checkpoint folder, its chat template, and streaming detokenization."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 6  # prompt tail decoded with the output so leading spaces survive


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or serialized AddedTokens."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template in a sandbox, with the helpers and whitespace rules transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> jinja2.Template:
    """A request's own chat template, compiled once for the requests that repeat it."""
    return compile_chat_template(source)


def _template_tree(source: str) -> nodes.Template | None:
    """A template's syntax tree; None when it does not parse (rendering then fails with the
    template's own error)."""
    try:
        return jinja2.Environment(extensions=[loopcontrols]).parse(source)
    except jinja2.TemplateSyntaxError:
        return None


def _key(node: nodes.Node) -> object:
    """The attribute or constant key a node reads (`m.content`, `m['content']`), if any."""
    if isinstance(node, nodes.Filter):  # `message['content'] | selectattr(...)`
        return _key(node.node) if node.node is not None else None
    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value
    return None


def chat_template_takes_content_parts(source: str) -> bool:
    """Whether a chat template renders a message `content` given as a list of {"type": ...}
    parts: it loops over a `content` or reads a `type` (vLLM's detection). Templates that do
    neither take `content` as a string only (e.g. ChatML's `'...' + message['content']`)."""
    tree = _template_tree(source)
    if tree is None:
        return True  # rendering it fails with the template's error
    loops_over_content = any(_key(loop.iter) == "content" for loop in tree.find_all(nodes.For))
    reads_type = any(_key(n) == "type" for n in tree.find_all((nodes.Getattr, nodes.Getitem)))
    return loops_over_content or reads_type


def chat_template_takes_tools(source: str) -> bool:
    """Whether a chat template renders a `tools` list (function definitions) at all."""
    tree = _template_tree(source)
    return tree is None or any(n.name == "tools" for n in tree.find_all(nodes.Name))


def chat_template_takes_tool_calls(source: str) -> bool:
    """Whether a chat template renders an assistant message's `tool_calls` at all."""
    tree = _template_tree(source)
    readers = () if tree is None else tree.find_all((nodes.Getattr, nodes.Getitem))
    return tree is None or any(_key(n) == "tool_calls" for n in readers)


class Tokenizer:
    """The tokenizer of a Hugging Face checkpoint folder (tokenizer.json and its configs)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tokenizer = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._config = _read_json(model_dir / "tokenizer_config.json")
        self._generation_config = _read_json(model_dir / "generation_config.json")
        self._model_config = _read_json(model_dir / "config.json")
        self._chat_template_source = self._find_chat_template(model_dir)
        self.bos_token = _token_content(self._config.get("bos_token"))
        self.eos_token = _token_content(self._config.get("eos_token"))
        self.pad_token = _token_content(self._config.get("pad_token"))
        self.unk_token = _token_content(self._config.get("unk_token"))
        self.model_max_length = int(self._config.get("model_max_length", 1 << 30))
        # Prepend BOS by hand only when the config asks for it and tokenizer.json does not add it.
        self._prepend_bos = (
            bool(self._config.get("add_bos_token", False))
            and self.bos_token_id is not None
            and self._tokenizer.encode("a", add_special_tokens=True).ids[:1] != [self.bos_token_id]
        )

    def _find_chat_template(self, model_dir: Path) -> str | None:
        if (model_dir / "chat_template.jinja").is_file():
            return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    # --- vocabulary ---

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def has_vocabulary_of(self, other: Tokenizer) -> bool:
        """Whether every token (added ones included) has the same id in both."""
        mine = self._tokenizer.get_vocab(with_added_tokens=True)
        return mine == other._tokenizer.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_to_id(self.pad_token)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Generation stops on any of these: generation_config's, then the tokenizer's EOS."""
        ids = _as_id_list(self._generation_config.get("eos_token_id"))
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            ids.append(self.token_to_id(self.eos_token))
        if not ids:
            text_config = self._model_config.get("text_config", self._model_config)
            ids = _as_id_list(text_config.get("eos_token_id"))
        return list(dict.fromkeys(ids))

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's spelling in the vocabulary: a text of n characters holds at
        least n / max_token_chars tokens (before normalization)."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def to_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what grammar libraries load)."""
        return self._tokenizer.to_str()

    @cached_property
    def special_ids(self) -> frozenset[int]:
        added = self._tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> str:
        """Text of `ids`; special tokens kept (`skip_special_tokens` False) are set apart by a
        space on each side with `spaces_between_special_tokens` (vLLM's default there)."""
        if skip_special_tokens or not spaces_between_special_tokens:
            return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for token_id in ids:
            if token_id in self.special_ids:
                if run:
                    pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self._tokenizer.id_to_token(token_id) or "")
            else:
                run.append(token_id)
        if run:
            pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return " ".join(pieces)

    # --- chat ---

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        if self._chat_template_source is None:
            raise ValueError("this tokenizer has no chat template")
        return compile_chat_template(self._chat_template_source)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages (content: a string or a list of {"type": ...} parts) to a prompt.

        The rendered prompt already holds any BOS the template adds: encode it with
        `add_special_tokens=False` (or use `encode_chat`). `chat_template`: a Jinja source
        used instead of the tokenizer's; `kwargs` are the template's other variables.
        """
        try:
            template = (
                self._compiled_chat_template
                if chat_template is None
                else _compiled_template(chat_template)
            )
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                unk_token=self.unk_token or "",
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        prompt = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(prompt, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one engine step at a time.

    Each step decodes only a short window (`ids[prefix_offset:]`) and emits the part past the
    already-emitted `ids[prefix_offset:read_offset]`. The offsets advance only when the window
    ends in a complete character, so a multi-byte character split over tokens is never cut and
    the deltas always concatenate to `decode(all ids)`. With stop strings, text that could be
    the start of one is held back until disambiguated, and nothing past a stop string is
    emitted (nor the stop string itself unless `include_stop_str_in_output`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Iterable[str] | str | None = (),
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [stop] if isinstance(stop, str) else [s for s in stop or () if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: no clean point to continue from
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

        self.output_text = ""  # decoded so far, cut at a stop string when one is hit
        self._num_emitted_chars = 0
        self.stop_str_hit: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_str_hit is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids, self._skip_special_tokens, self._spaces_between_special_tokens
        )

    def _decode_new_text(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing yet, or an incomplete character at the end: wait for more
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        hits = []
        for stop in self.stop:
            index = self.output_text.find(stop, search_from)
            if index >= 0:
                hits.append((index, -len(stop), stop))
        if not hits:
            return None
        index, _, stop = min(hits)
        return index, stop

    def _held_back_chars(self) -> int:
        """Length of the longest tail of the text that could start a stop string."""
        if self.include_stop_str_in_output:
            return 0
        text = self.output_text
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def go_on_from(self, token_ids: Sequence[int], sent_text: str) -> None:
        """Continue a stream whose first output `token_ids` were detokenized elsewhere and
        whose client got `sent_text` of their text: that text counts as output (a stop string
        that ends later is found across it), and what of it the client has not got (held
        back there) comes with the next delta. Fed one token at a time, as steps fed them
        there, so that a character split over tokens is cut where it was."""
        for token_id in token_ids:
            self._ids.append(token_id)
            self.output_text += self._decode_new_text(final=False)
        text = self.output_text
        self._num_emitted_chars = len(sent_text) if text.startswith(sent_text) else len(text)

    def update(self, new_token_ids: Iterable[int], final: bool = False) -> tuple[str, str | None]:
        """Feed this step's new ids; returns (text delta, the stop string hit or None).

        `final=True` flushes everything held back (the request is ending). After a stop
        string hit, further updates return ("", None).
        """
        if self.finished:
            return "", None
        self._ids.extend(new_token_ids)
        old_len = len(self.output_text)
        self.output_text += self._decode_new_text(final)

        hit = self._find_stop(max(0, old_len - self._max_stop_len + 1)) if self.stop else None
        if hit is not None:
            index, stop = hit
            self.output_text = self.output_text[
                : index + len(stop) * self.include_stop_str_in_output
            ]
            self.stop_str_hit = stop
            end = len(self.output_text)
        else:
            end = (
                len(self.output_text) if final else len(self.output_text) - self._held_back_chars()
            )
        end = max(end, self._num_emitted_chars)
        delta = self.output_text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta, hit[1] if hit is not None else None

    def flush(self) -> str:
        """Everything still held back, at the end of the request."""
        return self.update((), final=True)[0]
