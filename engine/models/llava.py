"""LLaVA-style model: CLIP vision tower + MLP projector + Llama-family decoder.

The runner merges image embeddings itself: it embeds the token ids with `embed_tokens`,
overwrites the rows at image placeholder positions with rows of `embed_images`, and calls
`forward` with the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.models.clip import ClipVisionTower, VisionConfig
from pdcluster.engine.models.llama import DecoderConfig, LlamaForCausalLM
from pdcluster.engine.models.mlp import get_act_fn

SELECT_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class LlavaConfig:
    text: DecoderConfig
    vision: VisionConfig
    feature_layers: tuple[int, ...]
    select_strategy: str  # "default" drops the CLS embedding, "full" keeps it
    projector_act: str
    projector_bias: bool
    image_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlavaConfig:
        text_cfg = dict(cfg.get("text_config") or {})
        text_type = text_cfg.get("model_type", "llama")
        if text_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"LLaVA text model {text_type!r} is not supported")
        text_cfg.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        layers = cfg.get("vision_feature_layer", -2)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r} not in {SELECT_STRATEGIES}"
            )
        image_token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
        if image_token_id is None:
            raise ValueError("LLaVA config has no image_token_id / image_token_index")
        return cls(
            text=DecoderConfig.from_hf(text_cfg, text_type),
            vision=VisionConfig.from_hf(cfg.get("vision_config") or {}),
            feature_layers=tuple(layers) if isinstance(layers, list) else (layers,),
            select_strategy=strategy,
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            image_token_id=int(image_token_id),
        )

    @property
    def num_image_tokens(self) -> int:
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)


class MultiModalProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = get_act_fn(act)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = ClipVisionTower(cfg.vision, list(cfg.feature_layers))
        self.multi_modal_projector = MultiModalProjector(
            cfg.vision.hidden_size * len(cfg.feature_layers),
            cfg.text.hidden_size,
            cfg.projector_act,
            cfg.projector_bias,
        )
        self.language_model = LlamaForCausalLM(cfg.text)

    def tie_weights(self) -> None:
        self.language_model.tie_weights()

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> [N, num_image_tokens, text_hidden]."""
        dtype = self.vision_tower.embeddings.patch_embedding.weight.dtype
        features = self.vision_tower(pixel_values.to(dtype))  # [N, P+1, D * n_layers]
        if self.config.select_strategy == "default":
            features = features[:, 1:]  # drop CLS
        return self.multi_modal_projector(features)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)  # [T, hidden]

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, kv_cache, meta)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)  # [N, vocab] float32
