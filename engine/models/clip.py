"""CLIP ViT vision tower, as used by LLaVA-style models.

Parameter names follow Hugging Face `CLIPVisionModel` without the `vision_model.` level
(`embeddings.*`, `pre_layrnorm.*`, `encoder.layers.N.*`); the loader maps checkpoints onto
them. Only the encoder layers that the selected feature layer needs are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.models.mlp import get_act_fn


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int  # layers in the checkpoint
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig:
        if cfg.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"vision tower {cfg.get('model_type')!r} is not supported (CLIP)")
        return cls(
            hidden_size=cfg.get("hidden_size", 768),
            intermediate_size=cfg.get("intermediate_size", 3072),
            num_layers=cfg.get("num_hidden_layers", 12),
            num_heads=cfg.get("num_attention_heads", 12),
            image_size=cfg.get("image_size", 224),
            patch_size=cfg.get("patch_size", 32),
            num_channels=cfg.get("num_channels", 3),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-5),
            hidden_act=cfg.get("hidden_act", "quick_gelu"),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ClipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels,
            cfg.hidden_size,
            kernel_size=cfg.patch_size,
            stride=cfg.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values)  # [N, D, S/p, S/p]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [N, 1, D]
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight  # [N, P+1, D]


class ClipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, heads, L, hd]
            return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # bidirectional
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))  # [N, L, D]


class ClipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = ClipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = ClipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(cfg) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """Pixels -> the hidden states of the requested encoder layers.

    `feature_layers` index the Hugging Face `hidden_states` tuple (0 = embeddings after
    pre_layrnorm, i = after layer i, negatives count from the end).
    """

    def __init__(self, cfg: VisionConfig, feature_layers: list[int]) -> None:
        super().__init__()
        self.config = cfg
        self.feature_layers = [i if i >= 0 else cfg.num_layers + 1 + i for i in feature_layers]
        if not all(0 <= i <= cfg.num_layers for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} out of range")
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = ClipEncoder(cfg, max(self.feature_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> [N, P+1, D * len(feature_layers)]."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))  # [N, P+1, D]
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)
