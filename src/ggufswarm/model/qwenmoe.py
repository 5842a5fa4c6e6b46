"""Qwen MoE family: ``qwen3moe`` (Qwen3-30B-A3B, 235B-A22B) and ``qwen2moe`` (Qwen1.5-MoE, Qwen2-57B-A14B):
the dense Qwen attention (qwen3: q/k RMSNorm; qwen2: q/k/v biases; NeoX RoPE) and a mixture-of-experts FFN in
every block.

Reference: llama.cpp ``src/models/qwen3moe.cpp`` (softmax router, top-k weights always renormalised, no shared
expert), ``src/models/qwen2moe.cpp`` (softmax router, weights not renormalised, a shared expert scaled by
``sigmoid(x · ffn_gate_inp_shexp)``) and ``build_moe_ffn`` in ``src/llama-graph.cpp``.
"""

from __future__ import annotations

from typing import Any

import torch

from .blocks import StepTables, gated_ffn, linear, moe_ffn, rms_norm, self_attention
from .config import ModelConfig, base_hparams, moe_hparams

ARCHITECTURES = ("qwen2moe", "qwen3moe")


def config(meta: dict[str, Any], arch: str, n_vocab: int) -> ModelConfig:
    """Hyperparameters of a ``qwen3moe`` / ``qwen2moe`` GGUF: the dense model's, plus ``expert_count``,
    ``expert_used_count``, ``expert_feed_forward_length`` (qwen2moe: ``expert_shared_feed_forward_length``).
    The router is a softmax; its top-k weights are renormalised for qwen3moe and not for qwen2moe, as the graphs
    fix it (``norm_w`` of ``build_moe_ffn``), whatever ``expert_weights_norm`` says; ``expert_weights_scale`` is not
    read (llama.cpp's loaders for these two leave it 0: no scaling)."""
    qwen3 = arch == "qwen3moe"
    return ModelConfig(
        **base_hparams(meta, arch, n_vocab),
        rope_type="neox",
        qk_norm=qwen3,
        qkv_bias=not qwen3,
        moe=moe_hparams(meta, arch, default_gating="softmax", weights_norm=qwen3, read_weights_scale=False),
    )


def shared_expert(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """qwen2moe's shared expert on normed ``x`` ``[T, n_embd]`` → ``[T, n_embd]``: the SwiGLU FFN ``*_shexp`` times
    its per-token gate ``sigmoid(x · ffn_gate_inp_shexp)`` (``ffn_gate_inp_shexp`` is ``[n_embd]``)."""
    gate = torch.sigmoid(
        linear(x, {"g": w["ffn_gate_inp_shexp"][None, :], "g.act": w.get("ffn_gate_inp_shexp.act")}, "g")
    )
    return gated_ffn(x, w, "silu", "_shexp") * gate


def block(
    cfg: ModelConfig,
    il: int,
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv,
    positions: torch.Tensor,
    rope: StepTables,
) -> torch.Tensor:
    """``h = x + attn(attn_norm(x)); out = h + moe(ffn_norm(h)) [+ shared expert]``; ``x`` ``[T, n_embd]``."""
    h = x + self_attention(cfg, il, rms_norm(x, w["attn_norm"], cfg.rms_eps), w, kv, positions, rope)
    f = rms_norm(h, w["ffn_norm"], cfg.rms_eps)
    y = moe_ffn(cfg, f, w)
    if "ffn_gate_inp_shexp" in w:
        y = y + shared_expert(f, w)
    return h + y


__all__ = ["ARCHITECTURES", "config", "block", "shared_expert"]
