"""Shared transformer pieces (norm, RoPE, attention over a KV cache, gated FFN), as llama.cpp builds them.

Shapes: ``x`` is ``[n_tokens, n_embd]``; q is ``[n_tokens, n_head, head_dim]``; k/v are
``[n_tokens, n_head_kv, head_dim]``. All math runs in the dtype of the inputs (float32 default).
Reference: llama.cpp ``src/llama-graph.cpp`` (``build_norm``, ``build_attn``, ``build_ffn``) and
``ggml_rope_ext`` in ``ggml/src/ggml-cpu/ops.cpp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (ggml ``rms_norm`` then ``mul``)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(head_dim: int, base: float, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``[head_dim // 2]``: ``base^(-2i/head_dim)``, divided by ``freq_factors`` (llama 3
    ``rope_freqs.weight``) when given, as in ggml. Depends only on the model: compute it once per shard."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return inv_freq / freq_factors.to(torch.float64) if freq_factors is not None else inv_freq


@dataclass
class StepTables:
    """What every layer of one forward step shares (built once per step, not per layer): RoPE ``cos`` / ``sin``
    ``[n_tokens, head_dim // 2]`` and the attention masks, one per sliding window (``mask``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict = field(default_factory=dict)

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor | None:
        """``attention_mask(q_pos, k_pos, window)``, built once per (window, keys) in this step; None for a
        single query (a decode step): the keys it is given (the window's, see ``self_attention``) are all
        allowed, and attention without a mask does less work."""
        if q_pos.shape[0] == 1:
            return None
        key = (window, int(k_pos[0]), k_pos.shape[0])
        found = self.masks.get(key)
        if found is None:
            found = self.masks[key] = attention_mask(q_pos, k_pos, window)
        return found


def yarn_inv_freq(inv_freq: torch.Tensor, n_rot: int, base: float, yarn) -> torch.Tensor:
    """float64 ``[n_rot // 2]``: ``inv_freq`` with YaRN's per-pair blend of extrapolation and interpolation
    (``yarn``: a ``YarnConfig``), so that ``rope_tables(pos, yarn_inv_freq(...), 1.0)`` turns pair ``j`` by ggml's
    ``theta_interp * (1 - mix) + theta_extrap * mix`` (``rope_yarn``, ``ggml-cpu/ops.cpp``)."""

    def corr_dim(n_rotations: float) -> float:  # ggml_rope_yarn_corr_dim
        return n_rot * math.log(yarn.n_ctx_orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(yarn.beta_fast)))
    high = min(n_rot - 1.0, math.ceil(corr_dim(yarn.beta_slow)))
    j = torch.arange(inv_freq.shape[0], dtype=torch.float64)
    ramp = 1 - ((j - low) / max(0.001, high - low)).clamp(0, 1)
    mix = ramp * yarn.ext_factor
    return inv_freq * (yarn.freq_scale * (1 - mix) + mix)


def rope_tables(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float32,
    magnitude: float = 1.0,
) -> StepTables:
    """cos/sin tables ``[n_tokens, head_dim // 2]`` for RoPE angle ``pos * scale * inv_freq`` (``rope_inv_freq``),
    times ``magnitude`` (YaRN's, ``YarnConfig.magnitude``; 1 otherwise).

    Angles are computed in float64 and rounded once, so every shard computes identical tables.
    """
    angles = positions.to(torch.float64)[:, None] * scale * inv_freq[None, :]
    if magnitude != 1.0:
        return StepTables((angles.cos() * magnitude).to(dtype), (angles.sin() * magnitude).to(dtype))
    return StepTables(angles.cos().to(dtype), angles.sin().to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str) -> torch.Tensor:
    """Rotate ``x`` ``[n_tokens, n_heads, head_dim]``; ``"norm"`` pairs (2i, 2i+1), ``"neox"`` pairs (i, i + d/2)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rope_type == "neox":
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half], x[..., half:]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean ``[n_q, n_k]``: True where query at ``q_pos`` may attend key at ``k_pos``.

    Causal; with ``window > 0`` also ``q_pos - k_pos < window`` (llama.cpp ``LLAMA_SWA_TYPE_STANDARD``).
    """
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window > 0:
        allowed &= diff < window
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query softmax attention. q ``[T, n_head, d]``, k/v ``[S, n_head_kv, d]``, mask ``[T, S]``
    (None: every key).

    Returns ``[T, n_head * d]``.
    """
    n_head, n_kv = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=n_head != n_kv
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def gelu_f16_table(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU: input rounded to f16, tanh-GELU looked up in an f16 table; 0 below -10, x above 10.

    ``ggml_vec_gelu_f32``/``ggml_vec_geglu_f32`` with ``GGML_GELU_FP16`` (``ggml-cpu/vec.h``).
    """
    y = F.gelu(x.half().float(), approximate="tanh").half().to(x.dtype)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


FFN_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh_f16": gelu_f16_table,
}


def gated_ffn(x: torch.Tensor, w: dict[str, torch.Tensor], act: str, suffix: str = "") -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` on ``x`` ``[T, n_embd]``; ``act`` is a key of FFN_ACTIVATIONS (SwiGLU /
    GeGLU). The tensors are ``ffn_gate{suffix}`` etc. (``suffix="_shexp"``: a MoE layer's shared expert)."""
    gate = FFN_ACTIVATIONS[act](linear(x, w, "ffn_gate" + suffix))
    return linear(gate * linear(x, w, "ffn_up" + suffix), w, "ffn_down" + suffix)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Round-trip ``x`` ``[..., n]`` through ggml's Q8_0 (32-value blocks, scale amax/127 stored as f16).

    This is what ggml's CPU backend does to activations before a dot product with Q4_0/Q5_0/Q8_0
    weights (``vec_dot_type`` in ``ggml-cpu.c``, ``quantize_row_q8_0`` in ``arch/x86/quants.c``).
    """
    xs = x.reshape(*x.shape[:-1], -1, 32)
    amax = xs.abs().amax(-1, keepdim=True)
    # torch.div on a tensor numerator: ``127.0 / t`` would compute 127 * (1/t), rounded differently from C
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), torch.zeros_like(amax))
    d = (amax / 127.0).half().float()
    return (torch.round(xs * inv) * d).reshape(x.shape)


def quantize_q8_k(x: torch.Tensor) -> torch.Tensor:
    """Round-trip ``x`` ``[..., n]`` through ggml's Q8_K (256-value blocks, f32 scale max/-127).

    Activations for K-quant weights (Q2_K..Q6_K) go through this (``quantize_row_q8_K_ref``).
    """
    xs = x.reshape(*x.shape[:-1], -1, 256)
    amax, idx = xs.abs().max(-1, keepdim=True)
    iscale = torch.where(amax > 0, torch.div(torch.full_like(amax, -127.0), xs.gather(-1, idx)), torch.zeros_like(amax))
    q = torch.clamp(torch.round(iscale * xs), max=127.0)
    d = torch.where(amax > 0, 1.0 / iscale, torch.zeros_like(amax))
    return (q * d).reshape(x.shape)


ACTIVATION_QUANT = {"q8_0": quantize_q8_0, "q8_k": quantize_q8_k}


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for tensor ``name`` (GGUF ``{name}.weight`` / ``{name}.bias``).

    When ``w[name + ".act"]`` names an activation format (``"q8_0"``/``"q8_k"``), ``x`` is first
    round-tripped through it, reproducing llama.cpp's CPU numerics for quantized weights.
    """
    act = w.get(name + ".act")
    if act is not None:
        x = ACTIVATION_QUANT[act](x)
    y = x @ w[name].T
    bias = w.get(name + ".bias")
    return y if bias is None else y + bias


def self_attention(
    cfg: ModelConfig,
    il: int,
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv,
    positions: torch.Tensor,
    rope: StepTables,
) -> torch.Tensor:
    """Attention sub-block of layer ``il`` on normed input ``x`` ``[T, n_embd]``, writing k/v into ``kv``.

    ``kv`` is the session's ``LayerKV`` for this layer; ``positions`` ``[T]`` are absolute token
    positions (contiguous, starting at ``kv.length``); ``rope``: this step's tables for the layer's RoPE.
    Returns ``[T, n_embd]`` after ``attn_output``.
    """
    T = x.shape[0]
    q = linear(x, w, "attn_q").view(T, cfg.n_head, cfg.head_dim)
    k = linear(x, w, "attn_k").view(T, cfg.n_head_kv, cfg.head_dim)
    v = linear(x, w, "attn_v").view(T, cfg.n_head_kv, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w["attn_q_norm"], cfg.rms_eps)
        k = rms_norm(k, w["attn_k_norm"], cfg.rms_eps)
    q = apply_rope(q, rope.cos, rope.sin, cfg.rope_type)
    k = apply_rope(k, rope.cos, rope.sin, cfg.rope_type)
    k_all, v_all, k_pos = kv.append(k, v)
    window = cfg.sliding_window[il]
    if window > 0:  # keys older than the window are masked anyway: skip them
        first = max(0, int(positions[0]) - window + 1)
        k_all, v_all, k_pos = k_all[first:], v_all[first:], k_pos[first:]
    return linear(attend(q, k_all, v_all, rope.mask(positions, k_pos, window), cfg.attn_scale), w, "attn_output")


def prenorm_block(
    cfg: ModelConfig,
    il: int,
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv,
    positions: torch.Tensor,
    rope: StepTables,
) -> torch.Tensor:
    """The llama-style block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``. ``x``: ``[T, n_embd]``."""
    h = x + self_attention(cfg, il, rms_norm(x, w["attn_norm"], cfg.rms_eps), w, kv, positions, rope)
    return h + gated_ffn(rms_norm(h, w["ffn_norm"], cfg.rms_eps), w, cfg.ffn_act)


EXPERT_GATING = {"softmax": lambda logits: torch.softmax(logits, dim=-1), "sigmoid": torch.sigmoid}
WEIGHTS_SUM_MIN = 6.103515625e-5  # llama.cpp clamps the picked weights' sum to the smallest normal f16


def expert_linear(x: torch.Tensor, w: dict, name: str, expert: int) -> torch.Tensor:
    """``x @ W[expert].T`` for a 3-D expert tensor ``name`` (GGUF ``{name}.weight``, ``[n_expert, n_out, n_in]``);
    ``x`` ``[N, n_in]`` → ``[N, n_out]``, with the activation rounding of ``linear`` (``{name}.act``)."""
    act = w.get(name + ".act")
    if act is not None:
        x = ACTIVATION_QUANT[act](x)
    return x @ w[name][expert].T


def route_experts(cfg: ModelConfig, x: torch.Tensor, w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a MoE layer on normed ``x`` ``[T, n_embd]``: ``(chosen, weights)``, both
    ``[T, n_expert_used]``: expert indices best first (int64) and their weights (``x``'s dtype).

    As ``build_moe_ffn`` (llama.cpp ``src/llama-graph.cpp``): ``probs = gating(x @ ffn_gate_inp.T)``; the
    top ``n_expert_used`` of ``probs + exp_probs_b`` (the DeepSeek-V3 selection bias, when the layer has
    it), with ``n_groups > 1`` only within the ``n_group_used`` groups of ``n_expert / n_groups`` consecutive
    experts whose two best selection scores sum highest (the others' scores set to -inf); weights are the picked
    *unbiased* probs, divided by their sum (clamped below at
    ``WEIGHTS_SUM_MIN``) when ``weights_norm``, times ``weights_scale`` unless that is 0 or 1.
    """
    moe = cfg.moe
    probs = EXPERT_GATING[moe.gating](linear(x, w, "ffn_gate_inp"))
    bias = w.get("exp_probs_b.bias")
    select = probs if bias is None else probs + bias
    if moe.n_groups > 1:
        groups = select.view(select.shape[0], moe.n_groups, -1)  # [T, n_groups, n_expert / n_groups]
        best = torch.topk(groups.topk(2, dim=-1).values.sum(-1), moe.n_group_used, dim=-1).indices
        keep = torch.zeros(groups.shape[:2], dtype=torch.bool).scatter_(1, best, True)
        select = groups.masked_fill(~keep[..., None], float("-inf")).view_as(select)
    chosen = torch.topk(select, moe.n_expert_used, dim=-1).indices
    weights = probs.gather(-1, chosen)
    if moe.weights_norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=WEIGHTS_SUM_MIN)
    if moe.weights_scale not in (0.0, 1.0):
        weights = weights * moe.weights_scale
    return chosen, weights


def moe_ffn(cfg: ModelConfig, x: torch.Tensor, w: dict, act: str = "silu") -> torch.Tensor:
    """Routed experts of a MoE layer on normed ``x`` ``[T, n_embd]`` → ``[T, n_embd]`` (no shared expert).

    Each token runs its ``n_expert_used`` experts (``route_experts``), each a gated FFN of the 3-D tensors
    ``ffn_gate_exps`` / ``ffn_up_exps`` ``[n_expert, n_ff_exp, n_embd]`` and ``ffn_down_exps``
    ``[n_expert, n_embd, n_ff_exp]``; the outputs are weighted and summed in the router's order, best first
    (llama.cpp ``build_moe_ffn``). Only the experts some token picked are computed.
    """
    chosen, weights = route_experts(cfg, x, w)
    out = x.new_zeros(x.shape[0], chosen.shape[1], x.shape[1])  # [T, n_expert_used, n_embd]
    for expert in chosen.unique().tolist():
        tok, slot = (chosen == expert).nonzero(as_tuple=True)
        xe = x[tok]
        h = FFN_ACTIVATIONS[act](expert_linear(xe, w, "ffn_gate_exps", expert)) * expert_linear(
            xe, w, "ffn_up_exps", expert
        )
        out[tok, slot] = expert_linear(h, w, "ffn_down_exps", expert)
    out = out * weights[..., None]
    y = out[:, 0]
    for i in range(1, out.shape[1]):
        y = y + out[:, i]
    return y
