"""What a shard file of layers ``[a, b)`` is written with beyond the sliced arrays, per architecture: the metadata
llama.cpp would otherwise derive from the shard's own layer count or block 0, and the global tensors a range leaves
out. ``archs.ARCH_RULES`` names the check of each architecture; each runs once the cut rules accepted the range
(``artifact/cut_rules.py``: which ranges a node refuses, the one source ``plan`` uses too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFValueType

from ...artifact import cut_checks
from ...artifact.cut_rules import Header
from ...artifact.gguf_file import GGUFModelFile


def _deepseek2_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/deepseek2.cpp: "lite" (no q_lora_rank) and the GLM-4.7-Lite gating default are
    # inferred from the layer count and the vocabulary size; resolve both from the whole model (a range read as lite
    # when the model is not: refused by the cut rules, cut_checks.deepseek2_check)
    h = Header(model.metadata)
    extra: dict[str, Any] = {}
    if cut_checks.deepseek2_lite(h, h.n_layers) and not cut_checks.deepseek2_lite(h, b - a):
        extra["deepseek2.attention.q_lora_rank"] = (0, GGUFValueType.UINT32)
    md = model.metadata
    if not md.get("deepseek2.expert_gating_func"):
        n_vocab = md.get("deepseek2.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
        glm_lite = h.n_layers in (47, 48) and n_vocab == 154880
        extra["deepseek2.expert_gating_func"] = (2 if glm_lite else 1, GGUFValueType.UINT32)  # sigmoid : softmax
    return extra


def glm_dsa_indexer_types(model: GGUFModelFile) -> list[int]:
    """Per-block indexer types (1 full, 0 shared) of a ``glm-dsa`` model (``cut_checks.glm_dsa_indexer_types``)."""
    return cut_checks.glm_dsa_indexer_types(Header(model.metadata))


def _glm_dsa_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # the shard's own pattern, written out: llama.cpp would otherwise default it from the shard's block 0 (a range
    # starting at a shared-indexer block: refused by the cut rules, cut_checks.glm_dsa_check)
    return {"glm-dsa.attention.indexer.types": (glm_dsa_indexer_types(model)[a:b], GGUFValueType.ARRAY)}


def _deepseek4_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/deepseek4.cpp: blocks il < hash_layer_count route by the token-id table (ffn_gate_tid2eid); a shard's
    # blocks are renumbered from 0, so the count is what is left of the leading hash blocks after the cut
    hashed = int(model.metadata.get("deepseek4.hash_layer_count", 0))
    return {"deepseek4.hash_layer_count": (max(0, hashed - a), GGUFValueType.UINT32)}


def _recurrent_heads_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/kimi-linear.cpp, bailingmoe3.cpp, kimi-k3.cpp: a recurrent (KDA) block, head_count_kv 0, computes
    # with hparams.n_head(), block 0's head count; a range starting at one (per-layer head_count 0 there) gives its
    # block 0 the whole model's block-0 count, which its KDA blocks then compute with as in the whole model
    arch = model.architecture
    heads = model.metadata.get(f"{arch}.attention.head_count")
    if not isinstance(heads, list) or int(heads[a]) != 0:
        return {}
    return {f"{arch}.attention.head_count": ([int(heads[0]), *(int(n) for n in heads[a + 1 : b])], GGUFValueType.ARRAY)}


def _ple_layers(model: GGUFModelFile, a: int, b: int) -> list[int]:
    """The blocks of ``[a, b)`` with qwen4exp's n-gram embedding (``ple.layers``: indices in the whole model),
    renumbered from ``a``."""
    layers = model.metadata.get("qwen4exp.ple.layers") or []
    return [int(il) - a for il in (layers if isinstance(layers, list) else [layers]) if a <= int(il) < b]


def _qwen4exp_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/qwen4exp.cpp load_arch_hparams: ple.layers lists block indices (not one flag per block); a range
    # without the PLE block lists none, and llama.cpp then loads no per-layer token embedding (_qwen4exp_unused)
    if "qwen4exp.ple.layers" not in model.metadata:
        return {}
    return {"qwen4exp.ple.layers": (_ple_layers(model, a, b), GGUFValueType.ARRAY)}


def _qwen4exp_unused(model: GGUFModelFile, a: int, b: int) -> frozenset[str]:
    # the n-gram embedding table is loaded only when the range holds the PLE block (ple_n_heads > 0)
    return frozenset() if _ple_layers(model, a, b) else frozenset({"per_layer_token_embd.weight"})


def _sqrt_n_embd(n_embd: int) -> np.float32:
    return np.sqrt(np.float32(n_embd))  # sqrtf(n_embd), src/models/gemma3.cpp (and gemma4.cpp)


def _headless_unused(model: GGUFModelFile, a: int, b: int) -> frozenset[str]:
    # a hybrid range without attention heads (recurrent blocks only) has head sizes of 0, and llama.cpp would size the
    # optional rope_freqs by them (src/models/granite-hybrid.cpp: {n_rot/2}, TENSOR_NOT_REQUIRED): no block uses it
    heads = model.metadata.get(f"{model.architecture}.attention.head_count")
    return frozenset({"rope_freqs.weight"}) if isinstance(heads, list) and not any(heads[a:b]) else frozenset()


def _gemma4_unused(model: GGUFModelFile, a: int, b: int) -> frozenset[str]:
    # src/models/gemma4.cpp load_arch_tensors: rope_freqs (the "proportional" RoPE's per-pair divisors) is created
    # for the full-attention blocks only; a range of sliding-window blocks alone never loads it
    swa = Header(model.metadata).swa
    return frozenset({"rope_freqs.weight"}) if swa is not None and all(swa[a:b]) else frozenset()


def _ernie45_moe_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # write the interleave_moe_layer_step that gives the range's blocks their kinds, counted from the file's block 0
    # (any libllama computes them so); a range no such step gives them (accepted only with patch 0020, whose graph
    # counts from the whole model's block 0: cut_checks.ernie45_moe_check) keeps the model's step and declares where
    # its blocks sit
    step = cut_checks.ernie45_moe_step(Header(model.metadata), a, b)
    if step is not None:
        return {"ernie4_5-moe.interleave_moe_layer_step": (step, GGUFValueType.UINT32)}
    return {"ernie4_5-moe.block_offset": (a, GGUFValueType.UINT32)}


def _minicpm_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/minicpm.cpp: residual_scale defaults to 1.4 / sqrt(n_layer) when the file has none
    if "minicpm.residual_scale" in model.metadata:
        return {}
    scale = np.float32(1.4) / np.sqrt(np.float32(n_model_layers(model)))
    return {"minicpm.residual_scale": (float(scale), GGUFValueType.FLOAT32)}


def _deepstack_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/llama-hparams.cpp n_embd_inp: n_embd * (1 + n_deepstack_layers) input values per token, the vision
    # deepstack features added to the first blocks (src/models/qwen3vl.cpp, granite.cpp); a token's own row is zero
    # past n_embd (build_inp_embd pads it), so for text the additions are + 0: a text shard drops them and takes
    # n_embd-wide hidden states
    arch = model.architecture
    md = model.metadata
    if int(md.get(f"{arch}.n_deepstack_layers", 0) or 0):
        return {f"{arch}.n_deepstack_layers": (0, GGUFValueType.UINT32)}
    if any(int(v) >= 0 for v in md.get(f"{arch}.deepstack_mapping", []) or []):
        return {f"{arch}.deepstack_mapping": ([], GGUFValueType.ARRAY)}  # (an empty array: the key left out)
    return {}


def n_model_layers(model: GGUFModelFile) -> int:
    """Blocks a route must cover: ``block_count`` less the MTP/nextn blocks (which no shard runs)."""
    return Header(model.metadata).n_layers
