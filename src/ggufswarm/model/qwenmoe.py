"""Qwen MoE family: ``qwen3moe`` (Qwen3-30B-A3B, 235B-A22B): qwen3 attention (q/k RMSNorm, NeoX RoPE) and a
mixture-of-experts FFN in every block.

Reference: llama.cpp ``src/models/qwen3moe.cpp`` (graph: softmax router, top-k weights always renormalised,
no shared expert) and ``build_moe_ffn`` in ``src/llama-graph.cpp``.
"""

from __future__ import annotations

from typing import Any

import torch

from .blocks import StepTables, moe_ffn, rms_norm, self_attention
from .config import ModelConfig, base_hparams, moe_hparams

ARCHITECTURES = ("qwen3moe",)


def config(meta: dict[str, Any], arch: str, n_vocab: int) -> ModelConfig:
    """Hyperparameters of a ``qwen3moe`` GGUF: qwen3's, plus ``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``; the router is a softmax and its top-k weights are renormalised
    (``build_moe_ffn(..., norm_w = true, ...)`` in ``qwen3moe.cpp``, whatever ``expert_weights_norm`` says)."""
    return ModelConfig(**base_hparams(meta, arch, n_vocab), rope_type="neox", qk_norm=True,
                       moe=moe_hparams(meta, arch, default_gating="softmax", weights_norm=True))


def block(cfg: ModelConfig, il: int, x: torch.Tensor, w: dict[str, torch.Tensor], kv,
          positions: torch.Tensor, rope: StepTables) -> torch.Tensor:
    """``h = x + attn(attn_norm(x)); out = h + moe(ffn_norm(h))``; ``x`` ``[T, n_embd]`` → ``[T, n_embd]``."""
    h = x + self_attention(cfg, il, rms_norm(x, w["attn_norm"], cfg.rms_eps), w, kv, positions, rope)
    return h + moe_ffn(cfg, rms_norm(h, w["ffn_norm"], cfg.rms_eps), w)


__all__ = ["ARCHITECTURES", "config", "block"]
