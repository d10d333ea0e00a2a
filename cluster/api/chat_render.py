"""Chat prompts: the served chat template (the model's, or `--chat-template`), or a request's
own, rendering the messages, the tools and the earlier calls.

What a template can take is read off its source once: content as a list of parts or as a
string (or as `--chat-template-content-format` says), a `tools` list, an assistant's
`tool_calls`. What it cannot take is given to it in a form it renders: tools as a system
prompt (`default_tool_prompt`), earlier calls as Hermes-style text in the assistant's content.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.tokens_protocol import TokenizeRequest
from pdcluster.cluster.api.tools import ToolCalling, default_tool_prompt
from pdcluster.engine.tokenizer import (
    Tokenizer,
    chat_template_takes_content_parts,
    chat_template_takes_tool_calls,
    chat_template_takes_tools,
)


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template renders, read off its source."""

    content_parts: bool  # content as a list of {"type": ...} parts (else a string)
    tools: bool  # a `tools` list
    tool_calls: bool  # an assistant message's `tool_calls`


@functools.lru_cache(maxsize=64)
def template_traits(source: str) -> TemplateTraits:
    return TemplateTraits(
        chat_template_takes_content_parts(source),
        chat_template_takes_tools(source),
        chat_template_takes_tool_calls(source),
    )


class ChatRenderer:
    """Renders chat requests with the served template unless the request brings its own.
    `content_format`: "auto" (as the template reads content), "string" or "openai" (parts)."""

    def __init__(
        self, tokenizer: Tokenizer, template: str | None = None, content_format: str = "auto"
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        self.content_format = content_format

    def render(
        self,
        body: ChatCompletionRequest | TokenizeRequest,
        add_generation_prompt: bool = True,
        calling: ToolCalling | None = None,
    ) -> str:
        """The chat prompt (with `calling`: the request's tools offered to the model); a
        template that fails on these messages is the client's error (ValueError)."""
        template, kwargs = self.template, {}
        if isinstance(body, ChatCompletionRequest):
            template = body.chat_template or template
            kwargs = body.template_kwargs()
        if template is None:
            raise ValueError(
                "this model has no chat template: serve it with --chat-template, or send "
                "chat_template in the request"
            )
        traits = template_traits(template)
        parts = traits.content_parts if self.content_format == "auto" else (
            self.content_format == "openai"
        )  # fmt: skip
        messages = body.template_messages(parts)
        if not traits.tool_calls:
            messages = [_calls_as_text(m) for m in messages]
        if calling is not None and traits.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in calling.tools]
        elif calling is not None:
            prompt = default_tool_prompt(calling.tools, calling.parser)
            messages = _with_system_prompt(messages, prompt, parts)
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt, chat_template=template, **kwargs
            )
        except TypeError as exc:  # e.g. the template adds a string to a non-string value
            raise ValueError(f"chat template failed: {exc}") from None
        if isinstance(body, ChatCompletionRequest) and body.continue_final_message:
            return _continued(prompt, messages[-1])
        return prompt


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's calls as `<tool_call>` blocks after its text, for a template
    that renders no `tool_calls`."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in calls
    ]
    text = _text_of(message.get("content"))
    content = "\n".join([text, *blocks] if text else blocks)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": content}


def _with_system_prompt(
    messages: list[dict[str, Any]], prompt: str, parts: bool
) -> list[dict[str, Any]]:
    """`prompt` after the first system message's text, or as a system message of its own."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content: Any = first["content"]
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": f"\n\n{prompt}"}]
        else:
            content = f"{content}\n\n{prompt}" if content else prompt
        return [{**first, "content": content}, *messages[1:]]
    content = [{"type": "text", "text": prompt}] if parts else prompt
    return [{"role": "system", "content": content}, *messages]


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if p.get("type") == "text")
    return content or ""


def _continued(prompt: str, final: dict[str, Any]) -> str:
    """The prompt cut right after the final message's text, so that the reply continues it
    (continue_final_message) instead of following the end of its turn."""
    content = final["content"]
    if isinstance(content, list):
        texts = [p["text"] for p in content if p.get("type") == "text"]
        content = texts[-1] if texts else ""
    end = prompt.rfind(content) if content else -1
    if end < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's "
            "text as sent, so it cannot be continued"
        )
    return prompt[: end + len(content)]
