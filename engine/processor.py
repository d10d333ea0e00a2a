"""Prompts (text, token ids, or dicts with images) -> validated `Request` objects."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from pdcluster.connectors.base import KVTransferParams
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.models.loader import ModelInfo
from pdcluster.engine.multimodal import (
    ImageProcessor,
    expand_image_placeholders,
    load_image,
    mm_hash,
)
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer

# A prompt: text, token ids, or {"prompt" | "prompt_token_ids": ..., "multi_modal_data":
# {"image": <PIL image | encoded bytes | list of them>}}.
PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    """Tokenizes prompts and preprocesses their images for one model."""

    def __init__(self, model_dir: str, tokenizer: Tokenizer, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.image_processor = (
            ImageProcessor.from_pretrained(model_dir) if info.is_multimodal else None
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        token_ids, images = self._tokens_and_images(prompt)
        truncate = params.truncate_prompt_tokens
        if truncate is not None and len(token_ids) > truncate:
            if images:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
            token_ids = token_ids[-truncate:]
        if params.bad_words and not params.bad_words_token_ids:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words(params))
        features = []
        if images or (
            self.info.image_token_id is not None and self.info.image_token_id in token_ids
        ):
            token_ids, features = self._expand_images(token_ids, images)
        return Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.info.eos_token_ids,
            mm_features=features,
            kv_transfer_params=kv_transfer_params,
            cache_salt=cache_salt,
            priority=priority,
            lora_request=lora_request,
        )

    def _bad_words(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's tokenizations on its own and after a space (mid-text), as vLLM."""
        found: dict[tuple[int, ...], None] = {}
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    found[tuple(ids)] = None
        return [list(ids) for ids in found]

    def _tokens_and_images(self, prompt: PromptType) -> tuple[list[int], list[Image.Image]]:
        if isinstance(prompt, str):
            return self._encode(prompt), []
        if isinstance(prompt, list):
            return self._check_token_ids(prompt), []
        if not isinstance(prompt, dict):
            raise ValueError(
                f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}"
            )
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"unknown prompt keys: {sorted(unknown)}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("'prompt' must be a string")
            token_ids = self._encode(prompt["prompt"])
        else:
            token_ids = self._check_token_ids(prompt["prompt_token_ids"])
        return token_ids, _images_of(prompt.get("multi_modal_data") or {})

    def _encode(self, text: str) -> list[int]:
        token_ids = self.tokenizer.encode(text)
        if not token_ids:
            raise ValueError("prompt is empty")
        return token_ids

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("prompt token ids must be a non-empty list of integers")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt token ids must be integers")
        vocab = self.info.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return list(token_ids)

    def _expand_images(
        self, token_ids: list[int], images: list[Image.Image]
    ) -> tuple[list[int], list]:
        if self.image_processor is None or self.info.image_token_id is None:
            raise ValueError("this model does not accept images")
        pixels: list[torch.Tensor | None] = [self.image_processor.preprocess(im) for im in images]
        hashes = [mm_hash(im) for im in images]
        return expand_image_placeholders(
            token_ids, self.info.image_token_id, self.info.num_image_tokens, pixels, hashes
        )


def _images_of(mm_data: dict[str, Any]) -> list[Image.Image]:
    unknown = set(mm_data) - {"image"}
    if unknown:
        raise ValueError(f"unsupported multi_modal_data keys: {sorted(unknown)} (only 'image')")
    items = mm_data.get("image", [])
    if not isinstance(items, Sequence) or isinstance(items, (bytes, str)):
        items = [items]
    return [_as_image(item) for item in items]


def _as_image(item: Any) -> Image.Image:
    if isinstance(item, Image.Image):
        return item
    if isinstance(item, (bytes, bytearray)):
        return load_image(bytes(item))
    if isinstance(item, io.IOBase):
        return load_image(item.read())
    raise ValueError(f"an image must be a PIL image or encoded bytes, not {type(item).__name__}")
