"""Tiny random-weight mixture-of-experts GGUFs, written with the ``gguf`` writer.

The companion of ``tinymodels`` for the MoE architectures of llama.cpp that we cannot
download at test time: ``qwen3moe``, ``qwen2moe``, ``deepseek`` (DeepSeek-MoE v1), ``deepseek2`` (MLA attention,
DeepSeek-V2/V3 style), ``glm4moe`` (GLM-4.5), ``gpt-oss``, the hybrid recurrent ``qwen3next``, ``qwen35moe`` and
``qwen35`` (dense), ``glm-dsa`` (GLM-5.2) and, with ``write_tiny_deepseek4_model``, ``deepseek4``
(DeepSeek-V4-Flash). Every file has the same small
SentencePiece-style vocabulary as ``tinymodels`` (``N_VOCAB`` = 384 tokens) and all-F32 weights, so
llama.cpp loads it and a forward pass takes milliseconds.

Layout of the defaults (``n_layers`` = 6, so tests can cut the model into the shards
``[0, 2) [2, 4) [4, 6)``):

* ``qwen3moe``: 8 experts, top-2, q/k RMS norms, normalised top-k softmax weights, every block MoE.
* ``qwen2moe``: 8 experts, top-2, q/k/v biases, softmax weights not renormalised, and a shared expert
  (``expert_shared_feed_forward_length`` = 96) scaled per token by ``sigmoid(x · ffn_gate_inp_shexp)``.
* ``deepseek``: 1 leading dense block (split point 2 falls after it), 8 experts top-2 plus
  2 shared experts, softmax gating, no weight normalisation.
* ``deepseek2``: MLA attention with a q LoRA (``q_lora_rank``, i.e. not the "lite" variant; ``q_lora_rank=0``
  writes the lite form's plain ``attn_q``),
  ``kv_lora_rank``, decoupled rope head dims, the split ``attn_k_b``/``attn_v_b`` tensors
  (``key_length_mla``/``value_length_mla`` set, the absorbed-MLA form llama.cpp converts to),
  3 leading dense blocks (split point 2 falls inside them, 4 after them), 8 experts top-2 plus
  1 shared expert, sigmoid gating with ``exp_probs_b`` selection bias, normalised weights scaled
  by ``expert_weights_scale`` (DeepSeek-V3 style); ``n_expert_groups`` / ``n_group_used`` (default 0: none)
  write group-limited routing (``expert_group_count`` / ``expert_group_used_count``); ``yarn_factor`` > 0 (default 0:
  none) writes YaRN RoPE scaling with ``yarn_orig_ctx`` and ``yarn_log_mul`` (``rope.scaling.yarn_log_multiplier``).
* ``glm4moe``: 2 leading dense blocks (split point 2 is exactly their end), q/k/v biases,
  q/k norms, partial rotary (``rope.dimension_count`` = head_dim / 2), ``post_attention_norm``
  as the FFN norm, sigmoid gating with ``exp_probs_b``, 1 shared expert, no MTP/nextn layers.
* ``qwen3next`` (Qwen3-Next, hybrid recurrent): ``full_attention_interval`` 3 (blocks 2 and 5 are gated full
  attention with a joint query+gate projection and q/k norms, the others gated delta-net blocks: fused
  ``attn_qkv`` + ``attn_gate`` projections, ``ssm_conv1d`` kernel 4, ``ssm_ba``, ``ssm_dt`` / ``ssm_a``,
  gated ``ssm_norm``, ``ssm_out``; 2 key heads and 4 value heads of 32), ``post_attention_norm``, 8 experts
  top-2 (softmax, normalised) plus a sigmoid-gated shared expert of 96. The recurrent blocks keep a fixed
  per-session state (``(conv_kernel - 1) * (inner + 2 * groups * state)`` + ``state * inner`` f32 values)
  instead of per-token KV.
* ``qwen35moe`` (Qwen3.5-MoE / Ornith): as ``qwen3next`` but ``ssm_beta`` and ``ssm_alpha`` instead of the joint
  ``ssm_ba``, and IMRoPE (``rope.dimension_sections`` 3/3/2/0 over ``rope.dimension_count`` 16 of the 32-wide
  heads): text positions enter as ``[p, p, p, 0]``.
* ``qwen35`` (dense Qwen3.5): ``qwen35moe``'s blocks with a plain SwiGLU FFN of 256, no experts.
* ``glm-dsa`` (GLM-5.2): ``deepseek2``'s MLA (q LoRA, split ``attn_k_b``/``attn_v_b``), 1 leading dense block,
  sigmoid routing with ``exp_probs_b``, 1 shared expert, and DSA: a lightning indexer (4 heads of 64: llama.cpp
  rotates its keys by a Hadamard matrix of at least 64, top-12 keys)
  on the "full" blocks (``indexer.*`` tensors), whose top-k the following "shared" blocks reuse. Without an
  ``indexer_types`` override no ``attention.indexer.types`` key is written and the trained context is 1M, so
  llama.cpp applies GLM-5.2's default pattern (blocks 0, 1, 2, 6, 10, ... full).
* ``gpt-oss``: alternating sliding-window / full attention (window 8, layers 0, 2, 4 are the
  sliding ones), attention sinks, q/k/v/o biases, router and expert biases, SwiGLU-OAI experts
  in F32 (no MXFP4), softmax over the selected router logits.

Any of the per-architecture settings in ``MOE_DEFAULTS`` can be changed with keyword overrides,
e.g. ``write_tiny_moe_model(p, "deepseek2", n_dense_lead=1, expert_gating_func=1)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, RopeScalingType
from tinymodels import N_VOCAB, add_test_vocab

MOE_ARCHS: tuple[str, ...] = (
    "qwen3moe",
    "qwen2moe",
    "deepseek",
    "deepseek2",
    "glm4moe",
    "gpt-oss",
    "qwen3next",
    "qwen35moe",
    "qwen35",
    "glm-dsa",
)

# expert_gating_func values (llama.cpp's llama_expert_gating_func_type)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2

_COMMON: dict[str, Any] = dict(
    n_embd=128,
    n_head=4,
    n_head_kv=2,
    head_dim=32,
    n_ff=256,
    n_ff_exp=64,
    n_expert=8,
    n_expert_used=2,
    context_length=4096,
    rope_freq_base=10000.0,
    rms_eps=1e-6,
)

MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3moe": dict(_COMMON),
    "qwen2moe": dict(_COMMON, n_ff_shexp=96),
    "deepseek": dict(_COMMON, n_head_kv=4, n_dense_lead=1, n_expert_shared=2),
    "deepseek2": dict(
        {k: v for k, v in _COMMON.items() if k not in ("n_head_kv", "head_dim")},  # MLA: own head dims
        n_dense_lead=3,
        n_expert_shared=1,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        expert_gating_func=GATING_SIGMOID,
        expert_weights_norm=True,
        expert_weights_scale=2.5,
        exp_probs_b=True,
        n_expert_groups=0,
        n_group_used=0,
        yarn_factor=0.0,
        yarn_orig_ctx=64,
        yarn_log_mul=0.1,
    ),
    "glm4moe": dict(
        _COMMON,
        n_dense_lead=2,
        n_expert_shared=1,
        rope_dim=16,
        expert_gating_func=GATING_SIGMOID,
        expert_weights_norm=True,
        expert_weights_scale=1.0,
    ),
    "gpt-oss": dict(_COMMON, sliding_window=8, n_swa_pattern=2),
    # hybrid: gated delta-net (recurrent) blocks and gated full attention; full_attention_interval 3 puts the
    # attention blocks at 2 and 5, so the middle shard [2, 4) starts on one (recomputed from the shard's own
    # block numbers, block 0 of it would be a delta-net block)
    "qwen3next": dict(
        _COMMON,
        n_ff_shexp=96,
        full_attention_interval=3,
        ssm_conv_kernel=4,
        ssm_state_size=32,
        ssm_group_count=2,
        ssm_time_step_rank=4,
    ),
    # Qwen3.5-MoE (Ornith-1.0-397B's architecture): qwen3next's blocks with separate ssm_beta / ssm_alpha
    # projections and interleaved multi-section RoPE (IMRoPE) on a partial rotary dimension
    # GLM-5.2 (DSA): deepseek2's MLA with a lightning indexer on the "full" blocks; the "shared" ones reuse the
    # top-k of the last full one. No indexer.types key and a 1M trained context: llama.cpp then applies
    # GLM-5.2's default pattern 1,1,1,0,0,0,1,0,... counted from the file's block 0
    "glm-dsa": dict(
        {k: v for k, v in _COMMON.items() if k not in ("n_head_kv", "head_dim")},
        context_length=1048576,
        n_dense_lead=1,
        n_expert_shared=1,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        expert_gating_func=GATING_SIGMOID,
        expert_weights_norm=True,
        expert_weights_scale=2.5,
        exp_probs_b=True,
        indexer_n_head=4,
        indexer_head_size=64,
        indexer_top_k=12,
        indexer_types=None,
    ),
    # the dense Qwen3.5 (Ornith's 9B / 31B sizes, if they are Qwen3.5-based): qwen35moe's blocks with a SwiGLU FFN
    "qwen35": dict(
        {k: v for k, v in _COMMON.items() if k not in ("n_ff_exp", "n_expert", "n_expert_used")},
        full_attention_interval=3,
        ssm_conv_kernel=4,
        ssm_state_size=32,
        ssm_group_count=2,
        ssm_time_step_rank=4,
        rope_dim=16,
        rope_sections=(3, 3, 2, 0),
    ),
    "qwen35moe": dict(
        _COMMON,
        n_ff_shexp=96,
        full_attention_interval=3,
        ssm_conv_kernel=4,
        ssm_state_size=32,
        ssm_group_count=2,
        ssm_time_step_rank=4,
        rope_dim=16,
        rope_sections=(3, 3, 2, 0),
    ),
}


def weight_writers(w: GGUFWriter, rng: np.random.Generator):
    """``(f32, norm, matrix)``: writers of random F32 tensors into ``w``. ``f32(name, *shape, scale, offset)``: entries
    ~ N(offset, scale^2); ``norm(name, dim)``: ~ N(1, 0.01); ``matrix(name, *shape, scale)``: a weight of numpy shape
    ``(..., n_out, n_in)``, entries ~ N(0, scale^2 / n_in)."""

    def f32(name: str, *shape: int, scale: float = 0.05, offset: float = 0.0) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale + offset).astype(np.float32))

    def norm(name: str, dim: int) -> None:
        f32(name, dim, scale=0.1, offset=1.0)

    def matrix(name: str, *shape: int, scale: float = 1.0) -> None:
        f32(name, *shape, scale=scale * shape[-1] ** -0.5)

    return f32, norm, matrix


def write_tiny_moe_model(path: Path, arch: str, *, n_layers: int = 6, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight MoE ``arch`` GGUF (one of ``MOE_ARCHS``) to ``path`` and return ``path``.

    ``overrides`` replace entries of ``MOE_DEFAULTS[arch]`` (unknown names raise ``TypeError``).
    All tensors are F32; expert tensors are 3-D, numpy shape ``(n_expert, n_out, n_in)``.
    """
    if arch not in MOE_DEFAULTS:
        raise ValueError(f"unknown MoE architecture {arch!r}; expected one of {MOE_ARCHS}")
    cfg = dict(MOE_DEFAULTS[arch])
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown settings for {arch}: {sorted(unknown)}")
    cfg.update(overrides)
    c = _Cfg(cfg)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)

    def kv_u32(key: str, value: int) -> None:
        w.add_uint32(f"{arch}.{key}", int(value))

    def kv_f32(key: str, value: float) -> None:
        w.add_float32(f"{arch}.{key}", float(value))

    w.add_block_count(n_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_head)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_freq_base)
    w.add_file_type(0)  # all F32
    dense = arch == "qwen35"  # the dense Qwen3.5: no experts at all
    if not dense:
        kv_u32("expert_count", c.n_expert)
        kv_u32("expert_used_count", c.n_expert_used)
        kv_u32("expert_feed_forward_length", c.n_ff_exp)
    if "n_dense_lead" in cfg:
        kv_u32("leading_dense_block_count", c.n_dense_lead)
    if "n_expert_shared" in cfg:
        kv_u32("expert_shared_count", c.n_expert_shared)
    if "n_ff_shexp" in cfg:
        kv_u32("expert_shared_feed_forward_length", c.n_ff_shexp)
    if "expert_gating_func" in cfg:
        kv_u32("expert_gating_func", c.expert_gating_func)
    if "expert_weights_scale" in cfg:
        kv_f32("expert_weights_scale", c.expert_weights_scale)
    if cfg.get("n_expert_groups", 0) > 1:  # DeepSeek-V3 group-limited routing
        kv_u32("expert_group_count", c.n_expert_groups)
        kv_u32("expert_group_used_count", c.n_group_used)
    if "expert_weights_norm" in cfg:
        w.add_bool(f"{arch}.expert_weights_norm", bool(c.expert_weights_norm))

    if arch in ("qwen3next", "qwen35moe", "qwen35"):
        kv_u32("full_attention_interval", c.full_attention_interval)
        kv_u32("ssm.conv_kernel", c.ssm_conv_kernel)
        kv_u32("ssm.state_size", c.ssm_state_size)
        kv_u32("ssm.group_count", c.ssm_group_count)
        kv_u32("ssm.time_step_rank", c.ssm_time_step_rank)
        kv_u32("ssm.inner_size", c.ssm_state_size * c.ssm_time_step_rank)
    if arch in ("qwen35moe", "qwen35"):
        w.add_array(f"{arch}.rope.dimension_sections", [int(v) for v in c.rope_sections])

    if arch == "glm-dsa":
        kv_u32("attention.indexer.head_count", c.indexer_n_head)
        kv_u32("attention.indexer.key_length", c.indexer_head_size)
        kv_u32("attention.indexer.top_k", c.indexer_top_k)
        kv_u32("nextn_predict_layers", 0)
        if c.indexer_types is not None:
            w.add_array(f"{arch}.attention.indexer.types", [int(v) for v in c.indexer_types])
    if arch == "glm-dsa":
        indexer_full = (
            list(c.indexer_types) if c.indexer_types is not None else [1, 1] + [1, 0, 0, 0] * ((n_layers + 3) // 4)
        )[:n_layers]

    if arch in ("deepseek2", "glm-dsa"):
        # MLA converted to MQA with one big kv head (what convert_hf_to_gguf.py writes)
        kv_u32("attention.head_count_kv", 1)
        kv_u32("attention.q_lora_rank", c.q_lora_rank)
        kv_u32("attention.kv_lora_rank", c.kv_lora_rank)
        kv_u32("attention.key_length", c.kv_lora_rank + c.qk_rope_head_dim)
        kv_u32("attention.value_length", c.kv_lora_rank)
        kv_u32("attention.key_length_mla", c.qk_nope_head_dim + c.qk_rope_head_dim)
        kv_u32("attention.value_length_mla", c.v_head_dim)
        kv_u32("rope.dimension_count", c.qk_rope_head_dim)
        kv_u32("vocab_size", N_VOCAB)
        if (
            cfg.get("yarn_factor", 0) > 0
        ):  # YaRN as DeepSeek-V2/V3 exports have it (the converter writes 0.1 * mscale_all_dim)
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(c.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(c.yarn_orig_ctx)
            w.add_rope_scaling_yarn_log_mul(c.yarn_log_mul)
    else:
        kv_u32("attention.head_count_kv", c.n_head_kv)
        kv_u32("attention.key_length", c.head_dim)
        kv_u32("attention.value_length", c.head_dim)
        kv_u32("rope.dimension_count", c.rope_dim if arch in ("glm4moe", "qwen35moe", "qwen35") else c.head_dim)
    if arch == "glm4moe":
        kv_u32("nextn_predict_layers", 0)
    if arch == "gpt-oss":
        kv_u32("attention.sliding_window", c.sliding_window)
        kv_u32("attention.sliding_window_pattern", c.n_swa_pattern)

    add_test_vocab(w)
    f32, norm, matrix = weight_writers(w, rng)

    e, d = c.n_embd, cfg.get("n_expert", 0)
    f32("token_embd.weight", N_VOCAB, e, scale=0.5)
    norm("output_norm.weight", e)
    matrix("output.weight", N_VOCAB, e)
    for il in range(n_layers):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", e)
        moe = il >= cfg.get("n_dense_lead", 0) and not dense

        # --- attention
        hybrid = arch in ("qwen3next", "qwen35moe", "qwen35")
        if hybrid and (il + 1) % c.full_attention_interval:  # a gated delta-net block
            key_dim = c.ssm_state_size * c.ssm_group_count
            value_dim = c.ssm_state_size * c.ssm_time_step_rank
            matrix(p + "attn_qkv.weight", 2 * key_dim + value_dim, e)
            matrix(p + "attn_gate.weight", value_dim, e)
            f32(p + "ssm_conv1d.weight", 2 * key_dim + value_dim, c.ssm_conv_kernel, scale=0.3)
            f32(p + "ssm_dt.bias", c.ssm_time_step_rank, scale=0.5)
            w.add_tensor(p + "ssm_a", -np.exp(rng.standard_normal(c.ssm_time_step_rank) * 0.5).astype(np.float32))
            if arch == "qwen3next":
                matrix(p + "ssm_ba.weight", 2 * c.ssm_time_step_rank, e)
            else:
                matrix(p + "ssm_beta.weight", c.ssm_time_step_rank, e)
                matrix(p + "ssm_alpha.weight", c.ssm_time_step_rank, e)
            norm(p + "ssm_norm.weight", c.ssm_state_size)
            matrix(p + "ssm_out.weight", e, value_dim)
        elif hybrid:  # gated full attention: the query projection carries the gate
            q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
            matrix(p + "attn_q.weight", 2 * q_dim, e)
            matrix(p + "attn_k.weight", kv_dim, e)
            matrix(p + "attn_v.weight", kv_dim, e)
            matrix(p + "attn_output.weight", e, q_dim)
            norm(p + "attn_q_norm.weight", c.head_dim)
            norm(p + "attn_k_norm.weight", c.head_dim)
        elif arch in ("deepseek2", "glm-dsa"):
            k_mla = c.qk_nope_head_dim + c.qk_rope_head_dim
            if c.q_lora_rank > 0:
                norm(p + "attn_q_a_norm.weight", c.q_lora_rank)
            norm(p + "attn_kv_a_norm.weight", c.kv_lora_rank)
            if c.q_lora_rank > 0:
                matrix(p + "attn_q_a.weight", c.q_lora_rank, e)
                matrix(p + "attn_q_b.weight", c.n_head * k_mla, c.q_lora_rank)
            else:  # the "lite" form (DeepSeek-V2-Lite): a plain query projection
                matrix(p + "attn_q.weight", c.n_head * k_mla, e)
            matrix(p + "attn_kv_a_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, e)
            # kv_b split per head; k_b is stored transposed (it maps q_nope into the kv latent):
            # ggml {nope, kv_lora_rank, n_head}, v_b ggml {kv_lora_rank, v_head_dim, n_head}
            matrix(p + "attn_k_b.weight", c.n_head, c.kv_lora_rank, c.qk_nope_head_dim)
            matrix(p + "attn_v_b.weight", c.n_head, c.v_head_dim, c.kv_lora_rank)
            matrix(p + "attn_output.weight", e, c.n_head * c.v_head_dim)
            if arch == "glm-dsa" and indexer_full[il]:  # the lightning indexer of a "full" block
                f32(p + "indexer.k_norm.weight", c.indexer_head_size, scale=0.1, offset=1.0)
                f32(p + "indexer.k_norm.bias", c.indexer_head_size, scale=0.1)
                matrix(p + "indexer.proj.weight", c.indexer_n_head, e)
                matrix(p + "indexer.attn_k.weight", c.indexer_head_size, e)
                matrix(p + "indexer.attn_q_b.weight", c.indexer_n_head * c.indexer_head_size, c.q_lora_rank)
        else:
            q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
            if arch == "deepseek" and q_dim != e:
                raise ValueError("deepseek needs n_head * head_dim == n_embd")
            matrix(p + "attn_q.weight", q_dim, e)
            matrix(p + "attn_k.weight", kv_dim, e)
            matrix(p + "attn_v.weight", kv_dim, e)
            matrix(p + "attn_output.weight", e, q_dim)
            if arch in ("glm4moe", "gpt-oss", "qwen2moe"):
                f32(p + "attn_q.bias", q_dim, scale=0.1)
                f32(p + "attn_k.bias", kv_dim, scale=0.1)
                f32(p + "attn_v.bias", kv_dim, scale=0.1)
            if arch in ("qwen3moe", "glm4moe"):
                norm(p + "attn_q_norm.weight", c.head_dim)
                norm(p + "attn_k_norm.weight", c.head_dim)
            if arch == "gpt-oss":
                f32(p + "attn_output.bias", e, scale=0.02)
                f32(p + "attn_sinks.weight", c.n_head, scale=0.5)

        # --- FFN norm: glm4moe and gpt-oss call it post_attention_norm
        norm(
            p
            + (
                "post_attention_norm.weight"
                if arch in ("glm4moe", "gpt-oss", "qwen3next", "qwen35moe", "qwen35")
                else "ffn_norm.weight"
            ),
            e,
        )

        # --- FFN
        if not moe:
            matrix(p + "ffn_gate.weight", c.n_ff, e)
            matrix(p + "ffn_up.weight", c.n_ff, e)
            matrix(p + "ffn_down.weight", e, c.n_ff)
            continue
        f = c.n_ff_exp
        matrix(p + "ffn_gate_inp.weight", d, e, scale=2.0)  # a sharper router: top-k differs per token
        matrix(p + "ffn_gate_exps.weight", d, f, e)
        matrix(p + "ffn_up_exps.weight", d, f, e)
        matrix(p + "ffn_down_exps.weight", d, e, f)
        if arch == "glm4moe" or (arch in ("deepseek2", "glm-dsa") and c.exp_probs_b):
            f32(p + "exp_probs_b.bias", d, scale=0.1)
        if arch == "gpt-oss":
            f32(p + "ffn_gate_inp.bias", d, scale=0.1)
            f32(p + "ffn_gate_exps.bias", d, f, scale=0.05)
            f32(p + "ffn_up_exps.bias", d, f, scale=0.05)
            f32(p + "ffn_down_exps.bias", d, e, scale=0.02)
        if arch in ("qwen2moe", "qwen3next", "qwen35moe"):
            f32(p + "ffn_gate_inp_shexp.weight", e, scale=e**-0.5 * 2.0)  # the shared expert's sigmoid gate
            matrix(p + "ffn_gate_shexp.weight", c.n_ff_shexp, e)
            matrix(p + "ffn_up_shexp.weight", c.n_ff_shexp, e)
            matrix(p + "ffn_down_shexp.weight", e, c.n_ff_shexp)
        if cfg.get("n_expert_shared", 0) > 0:
            fs = f * c.n_expert_shared
            matrix(p + "ffn_gate_shexp.weight", fs, e)
            matrix(p + "ffn_up_shexp.weight", fs, e)
            matrix(p + "ffn_down_shexp.weight", e, fs)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class _Cfg:
    """Attribute access to a settings dict."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


DEEPSEEK4_DEFAULTS: dict[str, Any] = dict(
    n_embd=128,
    n_head=4,
    head_dim=64,
    rope_dim=16,
    q_lora_rank=96,
    o_groups=2,
    o_lora_rank=32,
    hc_mult=4,
    n_ff_exp=64,
    n_expert=8,
    n_expert_used=2,
    n_expert_shared=1,
    compress_ratios=(0, 4, 128, 4),
    hash_layers=1,
    sliding_window=8,
    indexer_n_head=4,
    indexer_head_size=64,
    indexer_top_k=4,
    context_length=4096,
    rope_freq_base=10000.0,
    compress_rope_freq_base=160000.0,
    rms_eps=1e-6,
    swiglu_clamp=10.0,
    expert_weights_scale=1.5,
    sinkhorn_iters=3,
    hc_eps=1e-6,
)


def write_tiny_deepseek4_model(path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight ``deepseek4`` (DeepSeek-V4-Flash layout) GGUF to ``path`` and return ``path``.

    One block per entry of ``compress_ratios`` (default 0 / 4 / 128 / 4: raw sliding-window attention, the
    compressed attention with its lightning indexer, the heavily compressed one, the indexer again); a residual
    stream widened to ``hc_mult`` = 4 copies mixed by hyper-connections (Sinkhorn); the first ``hash_layers``
    blocks route tokens to experts by a fixed token-id table (``ffn_gate_tid2eid``), the others by
    sqrt-softplus scores with a selection bias; grouped low-rank output projection; attention sinks;
    8 experts top-2 plus a shared one with clamped SwiGLU. All F32 (the table int32). ``overrides`` replace
    entries of ``DEEPSEEK4_DEFAULTS`` (unknown names raise ``TypeError``).
    """
    cfg = dict(DEEPSEEK4_DEFAULTS)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown settings for deepseek4: {sorted(unknown)}")
    cfg.update(overrides)
    c = _Cfg(cfg)
    arch = "deepseek4"
    n_layers = len(c.compress_ratios)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    u32 = lambda key, v: w.add_uint32(f"{arch}.{key}", int(v))
    f32k = lambda key, v: w.add_float32(f"{arch}.{key}", float(v))
    w.add_block_count(n_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(c.n_ff_exp)
    w.add_head_count(c.n_head)
    u32("attention.head_count_kv", 1)
    u32("attention.key_length", c.head_dim)
    u32("attention.value_length", c.head_dim)
    u32("rope.dimension_count", c.rope_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_freq_base)
    w.add_file_type(0)
    u32("attention.q_lora_rank", c.q_lora_rank)
    u32("attention.sliding_window", c.sliding_window)
    u32("expert_count", c.n_expert)
    u32("expert_used_count", c.n_expert_used)
    u32("expert_feed_forward_length", c.n_ff_exp)
    u32("expert_shared_count", c.n_expert_shared)
    f32k("expert_weights_scale", c.expert_weights_scale)
    w.add_bool(f"{arch}.expert_weights_norm", True)
    u32("expert_gating_func", 4)  # sqrt(softplus)
    f32k("swiglu_clamp_exp", c.swiglu_clamp)
    u32("attention.indexer.head_count", c.indexer_n_head)
    u32("attention.indexer.key_length", c.indexer_head_size)
    u32("attention.indexer.top_k", c.indexer_top_k)
    u32("attention.output_group_count", c.o_groups)
    u32("attention.output_lora_rank", c.o_lora_rank)
    f32k("attention.compress_rope_freq_base", c.compress_rope_freq_base)
    w.add_array(f"{arch}.attention.compress_ratios", [int(r) for r in c.compress_ratios])
    u32("hyper_connection.count", c.hc_mult)
    u32("hyper_connection.sinkhorn_iterations", c.sinkhorn_iters)
    f32k("hyper_connection.epsilon", c.hc_eps)
    u32("hash_layer_count", c.hash_layers)
    add_test_vocab(w)
    f32, norm, matrix = weight_writers(w, rng)

    e, hd, hc = c.n_embd, c.head_dim, c.hc_mult
    mix = (2 + hc) * hc
    f32("token_embd.weight", N_VOCAB, e, scale=0.5)
    norm("output_norm.weight", e)
    matrix("output.weight", N_VOCAB, e)
    matrix("output_hc_fn.weight", hc, hc * e)
    f32("output_hc_base.weight", hc, scale=0.1)
    f32("output_hc_scale.weight", 1, scale=0.1, offset=1.0)
    for il, ratio in enumerate(c.compress_ratios):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", e)
        f32(p + "attn_sinks.weight", c.n_head, scale=0.5)
        matrix(p + "attn_q_a.weight", c.q_lora_rank, e)
        norm(p + "attn_q_a_norm.weight", c.q_lora_rank)
        matrix(p + "attn_q_b.weight", c.n_head * hd, c.q_lora_rank)
        matrix(p + "attn_kv.weight", hd, e)
        norm(p + "attn_kv_a_norm.weight", hd)
        matrix(p + "attn_output_a.weight", c.o_lora_rank * c.o_groups, c.n_head * hd // c.o_groups)
        matrix(p + "attn_output_b.weight", e, c.o_groups * c.o_lora_rank)
        for part in ("attn", "ffn"):
            matrix(p + f"hc_{part}_fn.weight", mix, hc * e)
            f32(p + f"hc_{part}_base.weight", mix, scale=0.1)
            f32(p + f"hc_{part}_scale.weight", 3, scale=0.1, offset=1.0)
        if ratio:
            coff = 2 if ratio == 4 else 1
            matrix(p + "attn_compressor_kv.weight", coff * hd, e)
            matrix(p + "attn_compressor_gate.weight", coff * hd, e)
            f32(p + "attn_compressor_ape.weight", ratio, coff * hd, scale=0.1)
            norm(p + "attn_compressor_norm.weight", hd)
            if ratio == 4:
                ih = c.indexer_head_size
                matrix(p + "indexer.proj.weight", c.indexer_n_head, e)
                matrix(p + "indexer.attn_q_b.weight", c.indexer_n_head * ih, c.q_lora_rank)
                matrix(p + "indexer_compressor_kv.weight", 2 * ih, e)
                matrix(p + "indexer_compressor_gate.weight", 2 * ih, e)
                f32(p + "indexer_compressor_ape.weight", ratio, 2 * ih, scale=0.1)
                norm(p + "indexer_compressor_norm.weight", ih)
        matrix(p + "ffn_gate_inp.weight", c.n_expert, e, scale=2.0)
        if il < c.hash_layers:  # token id -> its experts, fixed
            table = np.stack([rng.choice(c.n_expert, c.n_expert_used, replace=False) for _ in range(N_VOCAB)])
            w.add_tensor(p + "ffn_gate_tid2eid.weight", table.astype(np.int32))
        else:
            f32(p + "exp_probs_b.bias", c.n_expert, scale=0.1)
        norm(p + "ffn_norm.weight", e)
        f = c.n_ff_exp
        matrix(p + "ffn_gate_exps.weight", c.n_expert, f, e)
        matrix(p + "ffn_up_exps.weight", c.n_expert, f, e)
        matrix(p + "ffn_down_exps.weight", c.n_expert, e, f)
        fs = f * c.n_expert_shared
        matrix(p + "ffn_gate_shexp.weight", fs, e)
        matrix(p + "ffn_up_shexp.weight", fs, e)
        matrix(p + "ffn_down_shexp.weight", e, fs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
