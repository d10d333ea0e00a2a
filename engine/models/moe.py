"""Sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE).

A router (`gate`, a linear layer [hidden -> num_experts]) scores every token; each token is
sent to its `top_k` experts only, and their outputs are summed with the routing weights.
Parameter names follow Qwen3-MoE checkpoints (`mlp.gate`, `mlp.experts.N.gate_proj`, ...);
the loader renames Mixtral's (`block_sparse_moe.gate`, `block_sparse_moe.experts.N.w1`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdcluster.engine.models.mlp import GatedMLP


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert
    # Rescale the top-k probabilities to sum to 1. Softmax over all experts, top-k, then this
    # renormalisation equals a softmax over the top-k logits (Mixtral's routing).
    renormalize: bool
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (True) or a dense MLP

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
        """The mixture of a Mixtral or Qwen3-MoE config.json; None for a dense model."""
        if model_type == "mixtral":
            return cls(
                num_experts=cfg.get("num_local_experts", 8),
                top_k=cfg.get("num_experts_per_tok", 2),
                intermediate_size=cfg.get("intermediate_size", 14336),
                renormalize=True,
                sparse_layers=(True,) * num_layers,
            )
        if model_type != "qwen3_moe":
            return None
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts", 128)
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1)
        return cls(
            num_experts=num_experts,
            top_k=cfg.get("num_experts_per_tok", 8),
            intermediate_size=cfg.get("moe_intermediate_size", 768),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=tuple(
                i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
                for i in range(num_layers)
            ),
        )


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] in the logits' dtype, expert ids [T, top_k]).
    Probabilities are a float32 softmax over all experts; the top-k are kept (highest first)
    and, with `renormalize`, rescaled to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, act: str) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.intermediate_size, act, bias=False)
            for _ in range(moe.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Each expert runs once, on the tokens that chose it;
        a token's expert outputs are added in ascending expert order."""
        top_k = self.moe.top_k
        weights, expert_ids = route(self.gate(x), top_k, self.moe.renormalize)  # [T, k] each
        flat_ids = expert_ids.flatten()  # [T * k]
        order = torch.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
        token_rows = order // top_k  # [T * k]: the token of each pair
        pair_weights = weights.flatten()[order, None]  # [T * k, 1]
        counts = torch.bincount(flat_ids, minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(x)  # [T, hidden]
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = token_rows[start : start + count]  # [count]
                y = expert(x[rows]) * pair_weights[start : start + count]  # [count, hidden]
                out.index_add_(0, rows, y)
                start += count
        return out
