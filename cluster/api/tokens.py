"""`/tokenize` and `/detokenize` (vLLM's): the token ids a prompt or chat becomes, and back."""

from __future__ import annotations

from typing import Any

from pdcluster.cluster.api.errors import APIError
from pdcluster.cluster.api.serving import Serving
from pdcluster.cluster.api.tokens_protocol import DetokenizeRequest, TokenizeRequest


def tokenize(serving: Serving, body: TokenizeRequest) -> dict[str, Any]:
    """The prompt's token ids as a completion (or, for messages, a chat) would send them."""
    try:
        if body.messages is not None:
            text = serving.fits(serving.renderer.render(body, body.add_generation_prompt))
            add_special_tokens = bool(body.add_special_tokens)  # the template adds its own
        else:
            text = serving.fits(body.prompt or "")
            add_special_tokens = body.add_special_tokens is not False
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from None
    tokens = serving.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}


def detokenize(serving: Serving, body: DetokenizeRequest) -> dict[str, str]:
    tokenizer = serving.tokenizer
    for token_id in body.tokens:
        if not 0 <= token_id < tokenizer.vocab_size or tokenizer.id_to_token(token_id) is None:
            raise APIError(
                400,
                f"tokens: {token_id} is not a token id of this model "
                f"(vocabulary of {tokenizer.vocab_size})",
                "invalid_value",
                "tokens",
            )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
