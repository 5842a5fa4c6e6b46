"""DeepSeek-V2/V3 family (``deepseek2`` GGUFs): multi-head latent attention (MLA), leading dense blocks, routed
plus shared experts.

Reference: llama.cpp ``src/models/deepseek2.cpp`` (hparams, tensors and graph, its MLA "absorbed" form) and
``build_moe_ffn`` in ``src/llama-graph.cpp``. Only the MLA form of the GGUF is taken (``attn_k_b`` /
``attn_v_b`` split per head, ``attention.key_length_mla`` / ``value_length_mla`` set: what current
``convert_hf_to_gguf.py`` writes); the cache then holds, per token and layer, the normed latent
``kv_lora_rank`` values and the RoPE'd shared key ``rope_dim`` values, as llama.cpp's K-only cache does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .blocks import ACTIVATION_QUANT, StepTables, apply_rope, attend, gated_ffn, linear, moe_ffn, rms_norm
from .config import MLAConfig, ModelConfig, UnsupportedArchitecture, YarnConfig, base_hparams, meta_get, moe_hparams

ARCHITECTURES = ("deepseek2",)


def config(meta: dict[str, Any], arch: str, n_vocab: int) -> ModelConfig:
    """Hyperparameters of a ``deepseek2`` GGUF (llama.cpp ``llama_model_deepseek2::load_arch_hparams``).

    Heads: ``attention.key_length_mla`` = nope + rope dims per query/key head, ``value_length_mla`` per value
    head, ``rope.dimension_count`` the rotated dims; ``attention.q_lora_rank`` (0 or absent: the "lite" form
    with a plain ``attn_q``), ``attention.kv_lora_rank``. ``q·k`` is scaled by ``1/sqrt(key_length_mla)``.
    RoPE (``rope.dimension_count`` dims, adjacent pairs) may be YaRN-scaled (``_yarn``), which also scales ``q·k``.
    Experts: ``expert_gating_func`` (absent: softmax, sigmoid for GLM-4.7-Lite as llama.cpp guesses it),
    ``expert_weights_norm``, ``expert_weights_scale``, ``leading_dense_block_count``, ``expert_shared_count``.
    The MTP blocks (``nextn_predict_layers``) at the end are not part of the model run.
    """
    hp = base_hparams(meta, arch, n_vocab, yarn=True)
    k_mla = int(meta.get(f"{arch}.attention.key_length_mla", 0) or 0)
    v_mla = int(meta.get(f"{arch}.attention.value_length_mla", 0) or 0)
    if not (k_mla and v_mla):
        raise UnsupportedArchitecture(
            f"{arch}: a GGUF without attention.key_length_mla/value_length_mla (the legacy "
            f"attn_kv_b form) is not implemented by the torch backend; use --backend "
            f"llama.cpp"
        )
    if float(meta.get(f"{arch}.attention.temperature_scale", 0.0) or 0.0):
        raise UnsupportedArchitecture(
            f"{arch}: attention temperature scaling is not implemented by the torch backend; use --backend llama.cpp"
        )
    rope_dim = int(meta_get(meta, arch, "rope.dimension_count"))
    if not 0 < rope_dim < k_mla:
        raise ValueError(f"{arch}: rope.dimension_count {rope_dim} must be in 1..key_length_mla-1 ({k_mla - 1})")
    n_layers = hp["n_layers"] - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    for key in ("rope_base", "rope_scale", "sliding_window"):
        hp[key] = hp[key][:n_layers]
    yarn, mscale = _yarn(meta, arch, hp["context_length"])
    hp.update(n_layers=n_layers, head_dim=k_mla, attn_scale=mscale * mscale / math.sqrt(k_mla))
    mla = MLAConfig(
        q_lora_rank=int(meta.get(f"{arch}.attention.q_lora_rank", 0) or 0),
        kv_lora_rank=int(meta_get(meta, arch, "attention.kv_lora_rank")),
        nope_dim=k_mla - rope_dim,
        rope_dim=rope_dim,
        v_head_dim=v_mla,
    )
    glm47_lite = n_layers in (47, 48) and n_vocab == 154880
    moe = moe_hparams(meta, arch, default_gating="sigmoid" if glm47_lite else "softmax")
    return ModelConfig(**hp, rope_type="norm", rope_dim=rope_dim, moe=moe, mla=mla, yarn=yarn)


def _yarn(meta: dict[str, Any], arch: str, n_ctx_train: int) -> tuple[YarnConfig | None, float]:
    """``(YaRN settings or None, mscale)``; ``q·k`` is scaled by ``mscale^2 / sqrt(key_length_mla)``.

    As llama.cpp for deepseek2 (``llama-context.cpp``, ``deepseek2.cpp``, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]), with
    ``F = rope.scaling.factor`` and ``L = rope.scaling.yarn_log_multiplier / 0.1`` (the converter stores
    ``0.1 * mscale_all_dim``): ggml's RoPE magnitude is ``attn_factor * (1 + 0.1 ln F)`` with ``attn_factor``
    = ``(L != 0 ? 1 : 1 + 0.1 ln F) / (1 + 0.1 ln F) * rope.scaling.attn_factor``; ``mscale`` = that magnitude
    times ``1 + 0.1 L ln F``. ``ext_factor`` 1, ``beta_fast`` 32, ``beta_slow`` 1 unless the GGUF says otherwise;
    the original context is ``rope.scaling.original_context_length`` (else the trained one).
    """
    if meta.get(f"{arch}.rope.scaling.type") != "yarn":
        return None, 1.0
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    if factor <= 0:
        return None, 1.0
    log_mul = float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1
    gain = 1.0 + 0.1 * math.log(factor)  # ggml's own mscale factor for ext_factor != 0 (F > 1)
    mscale_of = lambda m: 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0
    attn_factor = (1.0 if log_mul != 0.0 else mscale_of(1.0)) / gain
    attn_factor *= float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0) or 1.0)
    ext = float(meta.get(f"{arch}.rope.scaling.yarn_ext_factor", -1.0))
    ext = 1.0 if ext < 0 else ext
    magnitude = attn_factor * gain if ext != 0.0 else attn_factor
    yarn = YarnConfig(
        freq_scale=1.0 / factor,
        ext_factor=ext,
        beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        n_ctx_orig=int(meta.get(f"{arch}.rope.scaling.original_context_length", 0) or n_ctx_train),
        magnitude=magnitude,
    )
    return yarn, attn_factor * gain * (1.0 + 0.1 * log_mul * math.log(factor))


def _per_head(x: torch.Tensor, w: dict, name: str, spec: str) -> torch.Tensor:
    """``einsum(spec, x, W)`` for the per-head 3-D tensor ``name`` (``attn_k_b`` ``[n_head, kv_lora_rank, nope]``,
    ``attn_v_b`` ``[n_head, v_head_dim, kv_lora_rank]``), with ``linear``'s activation rounding."""
    act = w.get(name + ".act")
    if act is not None:
        x = ACTIVATION_QUANT[act](x)
    return torch.einsum(spec, x, w[name])


def mla_attention(
    cfg: ModelConfig,
    il: int,
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv,
    positions: torch.Tensor,
    rope: StepTables,
) -> torch.Tensor:
    """MLA sub-block of layer ``il`` on normed ``x`` ``[T, n_embd]`` → ``[T, n_embd]``, appending to ``kv``.

    As llama.cpp's absorbed MLA (``deepseek2.cpp``, ``is_mla``): per head ``q = [q_nope, q_pe]``
    (``nope_dim + rope_dim``); the latent ``c = kv_a_norm(x @ attn_kv_a_mqa[:kv_lora_rank])`` and the shared
    key part ``k_pe = x @ attn_kv_a_mqa[kv_lora_rank:]``; RoPE on ``q_pe``/``k_pe``; ``q_nope`` is absorbed
    into latent space through ``attn_k_b``, so attention is MQA over one key head ``[c, k_pe]`` and value
    head ``c``; the ``[T, n_head, kv_lora_rank]`` result goes through ``attn_v_b`` per head
    (``[T, n_head, v_head_dim]``) and ``attn_output``. The cache keeps ``[c, k_pe]`` per token (``kv.k``
    ``[n, 1, kv_lora_rank + rope_dim]``; ``kv.v`` has width 0).
    """
    m, eps, T, H = cfg.mla, cfg.rms_eps, x.shape[0], cfg.n_head
    if "attn_q_a" in w:
        q = linear(rms_norm(linear(x, w, "attn_q_a"), w["attn_q_a_norm"], eps), w, "attn_q_b")
    else:
        q = linear(x, w, "attn_q")
    q = q.view(T, H, m.nope_dim + m.rope_dim)
    q_nope, q_pe = q[..., : m.nope_dim], q[..., m.nope_dim :]
    ckv = linear(x, w, "attn_kv_a_mqa")  # [T, kv_lora_rank + rope_dim]
    latent = rms_norm(ckv[:, : m.kv_lora_rank], w["attn_kv_a_norm"], eps)  # [T, kv_lora_rank]
    k_pe = apply_rope(ckv[:, None, m.kv_lora_rank :], rope.cos, rope.sin, cfg.rope_type)  # [T, 1, rope_dim]
    q_pe = apply_rope(q_pe, rope.cos, rope.sin, cfg.rope_type)
    q_abs = _per_head(q_nope, w, "attn_k_b", "thn,hrn->thr")  # [T, H, kv_lora_rank]
    k_all, _, k_pos = kv.append(torch.cat((latent[:, None, :], k_pe), dim=-1), latent.new_empty(T, 1, 0))
    out = attend(
        torch.cat((q_abs, q_pe), dim=-1),
        k_all,
        k_all[..., : m.kv_lora_rank],
        rope.mask(positions, k_pos, 0),
        cfg.attn_scale,
    )  # [T, H * kv_lora_rank]
    out = _per_head(out.view(T, H, m.kv_lora_rank), w, "attn_v_b", "thr,hvr->thv")  # [T, H, v_head_dim]
    return linear(out.reshape(T, H * m.v_head_dim), w, "attn_output")


def block(
    cfg: ModelConfig,
    il: int,
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv,
    positions: torch.Tensor,
    rope: StepTables,
) -> torch.Tensor:
    """``h = x + mla(attn_norm(x)); out = h + ffn(ffn_norm(h))``, ``x`` ``[T, n_embd]`` → ``[T, n_embd]``; the FFN is
    dense SwiGLU for ``il < n_dense_lead``, else routed experts plus the shared expert (``*_shexp``)."""
    h = x + mla_attention(cfg, il, rms_norm(x, w["attn_norm"], cfg.rms_eps), w, kv, positions, rope)
    f = rms_norm(h, w["ffn_norm"], cfg.rms_eps)
    if il < cfg.moe.n_dense_lead:
        return h + gated_ffn(f, w, "silu")
    y = moe_ffn(cfg, f, w)
    if "ffn_gate_shexp" in w:
        y = y + gated_ffn(f, w, "silu", "_shexp")
    return h + y


__all__ = ["ARCHITECTURES", "config", "block", "mla_attention"]
