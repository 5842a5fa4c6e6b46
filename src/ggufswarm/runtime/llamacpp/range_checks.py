"""Range checks of llama.cpp architectures: for a layer range ``[a, b)`` of a model, the metadata its shard needs
so that llama.cpp computes each block as in the whole model, or UnsupportedShard when a range cannot be run
(the rules a graph computes from the block index, per ``src/models/<arch>.cpp``). ``archs.ARCH_RULES`` names the
check of each architecture; the per-layer flags these checks compare come from ``archs`` (imported where used:
``archs`` imports this module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGUFValueType

from ...artifact.gguf_file import GGUFModelFile
from .errors import UnsupportedShard


def _gemma3_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    n = model.metadata["gemma3.block_count"]
    if n == 62 and (b - a) != n:  # src/models/gemma3.cpp: the 27B's attention scale is chosen by layer count
        raise UnsupportedShard(
            "gemma3 with 62 blocks (27B): llama.cpp picks its attention scale from the "
            "layer count, so a layer range of it would compute a different model"
        )
    return {}


def _deepseek2_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/deepseek2.cpp: "lite" (no q_lora_rank) and the GLM-4.7-Lite gating default are
    # inferred from the layer count and the vocabulary size; resolve both from the whole model.
    md = model.metadata
    n_vocab = md.get("deepseek2.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    n_layer = md["deepseek2.block_count"] - md.get("deepseek2.nextn_predict_layers", 0)

    def lite(n: int) -> bool:
        return n in (26, 27) or (n == 48 and n_vocab == 128256)

    extra: dict[str, Any] = {}
    if lite(n_layer) and not lite(b - a):
        extra["deepseek2.attention.q_lora_rank"] = (0, GGUFValueType.UINT32)
    elif lite(b - a) and not lite(n_layer):
        raise UnsupportedShard(
            f"deepseek2: a shard of {b - a} layers would be read as a 'lite' model by "
            f"llama.cpp; choose a different range"
        )
    if not md.get("deepseek2.expert_gating_func"):
        glm_lite = n_layer in (47, 48) and n_vocab == 154880
        extra["deepseek2.expert_gating_func"] = (2 if glm_lite else 1, GGUFValueType.UINT32)  # sigmoid : softmax
    return extra


def _hybrid_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    from .archs import recurrent_layers  # archs imports this module

    # src/llama-graph.cpp llm_graph_input_mem_hybrid::set_input fills the attention KV inputs and the recurrent
    # state-copy input unconditionally; a graph without an attention block (or without a recurrent one) never
    # allocates them and llama.cpp aborts on the first decode (GGML_ASSERT(buffer) in set_input_k_idxs)
    flags = recurrent_layers(model)[a:b]
    attention = _attention_layers(model)[a:b]
    if all(flags) or not any(flags) or not any(attention):
        kind = "recurrent" if not any(flags) else "full-attention"
        raise UnsupportedShard(
            f"{model.architecture}: layer range {a}:{b} has no {kind} block; llama.cpp's hybrid "
            f"memory aborts on a graph without both kinds (llm_graph_input_mem_hybrid::set_input), "
            f"so a shard must hold at least one recurrent and one full-attention block (a llama.cpp "
            f"change would lift this: set_input skipping the attention inputs and the state-copy "
            f"input when the graph did not allocate them)"
        )
    return {}


def _attention_layers(model: GGUFModelFile) -> list[bool]:
    """Per-block flags of a hybrid model: the block attends (has a KV cache): ``head_count_kv`` > 0 where llama.cpp's
    loader derives the recurrent blocks from ``head_count_kv`` (``ArchRules.recurrent``), else every block that is
    not recurrent."""
    from .archs import recurrent_layers, rules_for  # archs imports this module

    arch = model.architecture
    if arch in ("nemotron_h", "nemotron_h_moe"):  # src/models/nemotron-h.cpp: not recurrent, no feed-forward
        n = int(model.metadata[f"{arch}.block_count"])
        ff = _per_layer(model.metadata, f"{arch}.feed_forward_length", n)
        return [not r and f == 0 for r, f in zip(recurrent_layers(model), ff)]
    if rules_for(arch).recurrent is not None:
        return [k > 0 for k in _n_head_kv(model)]
    return [not r for r in recurrent_layers(model)]


def _per_layer(md: dict, key: str, n: int, default: int = 0) -> list[int]:
    """A hyperparameter llama.cpp reads with ``get_key_or_arr`` (one value, or one per block) as ``n`` values."""
    value = md.get(key, default)
    return [int(v) for v in value[:n]] if isinstance(value, list) else [int(value)] * n


# src/models/glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES: 1, 1, then 1, 0, 0, 0 repeated (1: the block has its own
# lightning indexer, 0: it reuses the top-k of the last full one); used when the file has no
# attention.indexer.types and a trained context of at least 1M (GLM-5.2); shorter contexts: every block full
_GLM_DSA_DEFAULT_PERIOD = (1, 0, 0, 0)


def glm_dsa_indexer_types(model: GGUFModelFile) -> list[int]:
    """Per-block indexer types (1 full, 0 shared) of a ``glm-dsa`` model's ``n_layer`` trunk blocks, as llama.cpp's
    loader reads or defaults them (``src/models/glm-dsa.cpp`` load_arch_hparams)."""
    md = model.metadata
    n = n_model_layers(model)
    types = md.get("glm-dsa.attention.indexer.types")
    if isinstance(types, list):
        return [int(t) for t in types][:n]
    if int(md.get("glm-dsa.context_length", 0)) < 1048576:  # "BC for GLM 5, 5.1 (full indexers)"
        return [1] * n
    return ([1, 1] + list(_GLM_DSA_DEFAULT_PERIOD) * (n // 4 + 1))[:n]


def _glm_dsa_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    types = glm_dsa_indexer_types(model)
    if not types[a]:
        full = [i for i, t in enumerate(types) if t]
        raise UnsupportedShard(
            f"glm-dsa: block {a} is a shared-indexer block (it reuses the top-k of full-indexer block "
            f"{max((i for i in full if i < a), default=None)}, which llama.cpp cannot take across a cut: "
            f"src/models/glm-dsa.cpp asserts prev_top_k); a layer range must start at a "
            f"full-indexer block ({', '.join(map(str, full))})"
        )
    # the shard's own pattern, written out: llama.cpp would otherwise default it from the shard's block 0
    return {"glm-dsa.attention.indexer.types": (types[a:b], GGUFValueType.ARRAY)}


def _deepseek4_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/deepseek4.cpp: blocks il < hash_layer_count route by the token-id table (ffn_gate_tid2eid); a shard's
    # blocks are renumbered from 0, so the count is what is left of the leading hash blocks after the cut
    hashed = int(model.metadata.get("deepseek4.hash_layer_count", 0))
    return {"deepseek4.hash_layer_count": (max(0, hashed - a), GGUFValueType.UINT32)}


def _hc_streams(metadata: dict) -> int:
    return max(1, int(metadata.get("deepseek4.hyper_connection.count", 1) or 1))


def _sqrt_n_embd(n_embd: int) -> np.float32:
    return np.sqrt(np.float32(n_embd))  # sqrtf(n_embd), src/models/gemma3.cpp (and gemma4.cpp)


def _gemma4_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/gemma4.cpp; the layer-count switch in load_arch_hparams only names the model type (no number
    # depends on it) and f_attention_scale is fixed at 1.0, so a dense range needs nothing written
    md = model.metadata
    if (a, b) == (0, n_model_layers(model)):
        return {}  # the whole model: llama.cpp's own graph from token ids
    if int(md.get("gemma4.embedding_length_per_layer_input", 0) or 0):
        raise UnsupportedShard(
            f"gemma4 with per-layer token embeddings (E2B/E4B: embedding_length_per_layer_input > 0): llama.cpp "
            f"computes every block's per-layer input at the start of the graph from the token ids and the first "
            f"block's input (build_inp_per_layer / project_per_layer_inputs); a shard given hidden states would use "
            f"the padding token's row and its own input instead, so only the whole model runs (layer range {a}:{b})"
        )
    if int(md.get("gemma4.attention.shared_kv_layers", 0) or 0):
        raise UnsupportedShard(
            f"gemma4 with shared-KV layers (attention.shared_kv_layers > 0): its last blocks attend with the KV cache "
            f"of earlier blocks, which llama.cpp finds by counting from the shard's own layer count "
            f"(n_layer_kv_from_start), so only the whole model runs (layer range {a}:{b})"
        )
    if b - a < 2:
        raise UnsupportedShard(
            f"gemma4: layer range {a}:{b} has one block; llama.cpp's KV cache for gemma4 asserts at least two KV "
            f"layers (src/llama-model.cpp create_memory: GGML_ASSERT(hparams.n_layer_kv_from_start >= 2)), which "
            f"would abort the node; a shard needs two blocks or more"
        )
    return {}


def _gemma4_unused(model: GGUFModelFile, a: int, b: int) -> frozenset[str]:
    from .archs import ARCH_RULES, swa_layers  # archs imports this module

    # src/models/gemma4.cpp load_arch_tensors: rope_freqs (the "proportional" RoPE's per-pair divisors) is created
    # for the full-attention blocks only; a range of sliding-window blocks alone never loads it
    swa = swa_layers(model, ARCH_RULES["gemma4"])
    return frozenset({"rope_freqs.weight"}) if swa is not None and all(swa[a:b]) else frozenset()


# -- rules grown from llama.cpp's architecture zoo (tests/zoo.py: test-llama-archs models as layer ranges) -------------


def _all_recurrent(model: GGUFModelFile) -> list[bool]:
    """Every trunk block recurrent (Mamba, Mamba-2; Falcon-H1, whose every block runs an SSM beside its attention)."""
    n = int(model.metadata[f"{model.architecture}.block_count"])
    return [il < n_model_layers(model) for il in range(n)]


def _kv0_recurrent(model: GGUFModelFile) -> list[bool]:
    """A block is recurrent where its ``head_count_kv`` is 0 (``src/models/jamba.cpp``, ``granite-hybrid.cpp``,
    ``plamo2.cpp``, ``lfm2.cpp``, ``lfm2moe.cpp``, ``kimi-linear.cpp``, ``bailingmoe3.cpp``: ``is_recr_impl[i] =
    n_head_kv(i) == 0``); MTP blocks are not."""
    n = int(model.metadata[f"{model.architecture}.block_count"])
    kv = _n_head_kv(model)
    return [il < n_model_layers(model) and kv[il] == 0 for il in range(n)]


def _n_head_kv(model: GGUFModelFile) -> list[int]:
    """KV heads of every block (``attention.head_count_kv``, one value or one per block; ``head_count`` without it)."""
    md, arch = model.metadata, model.architecture
    n = int(md[f"{arch}.block_count"])
    key = f"{arch}.attention.head_count_kv"
    return _per_layer(md, key if key in md else f"{arch}.attention.head_count", n)


def _nemotron_h_recurrent(model: GGUFModelFile) -> list[bool]:
    """``src/models/nemotron-h.cpp``: a Mamba-2 block has neither KV heads nor a feed-forward (``n_head_kv(i) == 0 &&
    n_ff(i) == 0``); the others are attention blocks (KV heads) or MLP-only blocks."""
    md, arch = model.metadata, model.architecture
    n = int(md[f"{arch}.block_count"])
    kv = _n_head_kv(model)
    ff = _per_layer(md, f"{arch}.feed_forward_length", n)
    return [il < n_model_layers(model) and kv[il] == 0 and ff[il] == 0 for il in range(n)]


def _same_flags(model: GGUFModelFile, a: int, b: int, what: str, flag: Callable[[int, int], bool], source: str) -> None:
    """UnsupportedShard unless ``flag(il, n_layer)``, a per-block rule llama.cpp computes from the block index ``il``
    and
    the file's block count, gives blocks ``[a, b)`` of a shard file (``il`` from 0, ``n_layer = b - a``) what it gives
    them in the whole model."""
    n = n_model_layers(model)
    whole = [flag(il, n) for il in range(a, b)]
    local = [flag(il, b - a) for il in range(b - a)]
    if whole != local:
        raise UnsupportedShard(
            f"{model.architecture}: {what} counts from a file's block 0 ({source}), so a shard file of "
            f"blocks {a}:{b} would get it wrong; choose a range that keeps it (a "
            f"llama.cpp change reading it from a per-layer array would lift this)"
        )


def _no_rope_every_4(source: str) -> Callable[[GGUFModelFile, int, int], dict[str, Any]]:
    """A check keeping the rule ``use_rope = (il + 1) % 4 != 0`` (every 4th block without RoPE, counted from the
    file's block 0; ``source``: where llama.cpp says so) right in a shard."""

    def check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
        _same_flags(model, a, b, "the no-RoPE block of every 4", lambda il, n: (il + 1) % 4 != 0, source)
        return {}

    return check


def _smallthinker_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    if int(model.metadata.get("smallthinker.attention.sliding_window", 0) or 0) > 0:
        _same_flags(
            model,
            a,
            b,
            "the no-RoPE block of every 4",
            lambda il, n: n == 4 or il % 4 != 0,
            "src/models/smallthinker.cpp: use_rope = n_no_rope_layer_step == n_layer || il % "
            "n_no_rope_layer_step != 0, a step of 4 with SWA",
        )
    return {}


def _llama4_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    md = model.metadata
    step = int(md.get("llama4.interleave_moe_layer_step", 0) or 0)
    _same_flags(
        model,
        a,
        b,
        "the MoE block of every interleave_moe_layer_step",
        lambda il, n: step > 0 and (il + 1) % step == 0,
        "src/models/llama4.cpp: is_moe_layer = (i + 1) % n_moe_layer_step == 0",
    )
    chunked = not ("llama4.attention.sliding_window" in md and int(md["llama4.attention.sliding_window"]) == 0)
    _same_flags(
        model,
        a,
        b,
        "the no-RoPE block",
        lambda il, n: (il + 1) % (4 if chunked else n) != 0,
        "src/models/llama4.cpp: use_rope = (il + 1) % n_no_rope_layer_step != 0, a step of 4 with chunked "
        "attention, else the layer count",
    )
    return {}


def _ernie45_moe_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/ernie4-5.cpp loads expert tensors for il >= leading_dense_block_count, and ernie4-5-moe.cpp runs them
    # where also (il + 1) % interleave_moe_layer_step == 0: write the step that gives the range's blocks their kinds
    md = model.metadata
    lead = int(md.get("ernie4_5-moe.leading_dense_block_count", 0) or 0)
    step = int(md["ernie4_5-moe.interleave_moe_layer_step"])
    moe = [il >= lead and (il + 1) % step == 0 for il in range(a, b)]
    lead2 = max(0, lead - a)
    for s in range(1, b - a + 2):
        if all(m == (il >= lead2 and (il + 1) % s == 0) for il, m in enumerate(moe)):
            return {"ernie4_5-moe.interleave_moe_layer_step": (s, GGUFValueType.UINT32)}
    raise UnsupportedShard(
        f"ernie4_5-moe: no interleave_moe_layer_step gives blocks {a}:{b} their MoE pattern "
        f"(src/models/ernie4-5-moe.cpp: is_moe_layer = il >= lead && (il + 1) % step == 0)"
    )


def _whole_layers_check(arch: str, n_whole: int, what: str) -> Callable[[GGUFModelFile, int, int], dict[str, Any]]:
    """A check refusing ranges of a model of ``n_whole`` blocks, where llama.cpp keys ``what`` on that block count."""

    def check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
        n = n_model_layers(model)
        if n == n_whole and b - a != n:
            raise UnsupportedShard(
                f"{arch} with {n} blocks: llama.cpp {what}, so a shard of {b - a} blocks would "
                f"compute a different model"
            )
        return {}

    return check


def _command_r_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    n = n_model_layers(model)
    if n >= 64 and b - a < 64:  # src/models/command-r.cpp: if (n_layer >= 64) attn_q_norm, attn_k_norm
        raise UnsupportedShard(
            f"command-r with {n} blocks (Command R+): llama.cpp loads the per-head Q/K norms only "
            f"for a file of 64 blocks or more (src/models/command-r.cpp), so a shard of {b - a} "
            f"blocks would drop them"
        )
    return {}


def _nanbeige_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    loops = int(model.metadata.get("nanbeige.num_loops", 1) or 1)
    if loops > 1 and (a, b) != (0, n_model_layers(model)):
        raise UnsupportedShard(
            f"nanbeige with num_loops {loops}: llama.cpp runs the file's blocks {loops} times over "
            f"(src/models/nanbeige.cpp), a loop no layer range can cut"
        )
    return {}


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


def _first_block_heads(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/models/kimi-linear.cpp, bailingmoe3.cpp: the recurrent (KDA) blocks take their head count from
    # hparams.n_head(), the file's block 0
    heads = model.metadata.get(f"{model.architecture}.attention.head_count")
    if isinstance(heads, list) and int(heads[a]) != int(heads[0]):
        raise UnsupportedShard(
            f"{model.architecture}: its recurrent blocks take their head count from a file's block 0 "
            f"(hparams.n_head(), src/models/{model.architecture}.cpp): block {a} has {heads[a]} heads, "
            f"block 0 {heads[0]}, so a range must start at a block with {heads[0]}"
        )
    return _hybrid_check(model, a, b)


def _minimax_m3_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    lead = int(model.metadata.get("minimax-m3.leading_dense_block_count", 0) or 0)
    if b <= lead:  # src/models/minimax-m3.cpp: is_sparse = msa_enabled && il >= n_layer_dense_lead
        raise UnsupportedShard(
            f"minimax-m3: layer range {a}:{b} holds only leading dense-attention blocks (0:{lead}); "
            f"the graph creates its sparse-attention (MSA) inputs whenever flash attention is on, "
            f"and llama.cpp aborts setting them when no block used them (llm_graph_input_msa::"
            f"set_input, GGML_ASSERT(buffer)); a range needs a block from {lead} on (or a llama.cpp "
            f"change creating the MSA inputs only for a graph with a sparse block)"
        )
    return {}


def _dots3note_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    types = model.metadata.get("dots3note.attention.indexer.types")
    if isinstance(types, list) and not any(int(t) for t in types[a:b]):
        raise UnsupportedShard(
            f"dots3note: layer range {a}:{b} holds no block with a lightning indexer (its "
            f"full-attention blocks: attention.indexer.types); the graph's DSA inputs are then never "
            f"allocated and llama.cpp aborts setting them (GGML_ASSERT(buffer)); a range needs one "
            f"(or a llama.cpp change skipping the indexer inputs of a graph without one)"
        )
    return {}


def _kimi_k3_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    if int(model.metadata.get("kimi-k3.attn_res.block_size", 0) or 0) > 0:
        raise UnsupportedShard(
            "kimi-k3 with attention residuals (attn_res.block_size > 0): every block mixes a bank of "
            "earlier blocks' inputs (res_push / res_mix, src/models/kimi-k3.cpp), more than one "
            "hidden state per token crosses a cut; only the whole model runs (a llama.cpp change "
            "taking the bank through batch.embd, as 0002 does DeepSeek-V4's streams, would lift it)"
        )
    return _hybrid_check(model, a, b)


def _checks(
    *checks: Callable[[GGUFModelFile, int, int], dict[str, Any]],
) -> Callable[[GGUFModelFile, int, int], dict[str, Any]]:
    """One check running ``checks`` in turn (the extra metadata of all of them)."""

    def check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for c in checks:
            extra.update(c(model, a, b))
        return extra

    return check


# why a layer range of these cannot run (whole model only), from src/models/<arch>.cpp


def n_model_layers(model: GGUFModelFile) -> int:
    """Blocks a route must cover: ``block_count`` less the MTP/nextn blocks (which no shard runs)."""
    arch = model.architecture
    return int(model.metadata[f"{arch}.block_count"]) - int(model.metadata.get(f"{arch}.nextn_predict_layers", 0))
