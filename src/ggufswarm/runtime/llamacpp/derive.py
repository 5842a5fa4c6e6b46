"""Derived shard GGUFs: blocks ``[a, b)`` of a model renumbered from 0, metadata fixed so llama.cpp runs them as it would inside the whole model.

llama.cpp builds a model's graph from ``{arch}.block_count`` and per-layer hyperparameters that
it either reads from arrays or computes from the *absolute* layer index (the sliding-window
pattern, leading dense blocks, MTP/nextn blocks). A shard file therefore has to say explicitly
what each of its layers was in the whole model. The rules live in ``ARCH_RULES``, one entry per
architecture, taken from llama.cpp's ``src/models/<arch>.cpp`` (``load_arch_hparams``) and
``src/llama-hparams.cpp`` (``set_swa_pattern``) as bundled with llama-cpp-python 0.3.36:

* every ``{arch}.*`` array with one entry per block is sliced to ``[a, b)``;
* ``sliding_window_pattern`` is written as a per-layer bool array (llama.cpp accepts an array;
  its default pattern counts from the shard's own layer 0, which is wrong for most ``a``);
* ``leading_dense_block_count`` becomes ``max(0, lead - a)``;
* hybrid recurrent models (``qwen3next``: gated delta-net blocks between full-attention ones) get
  ``attention.recurrent_layers`` as a per-layer bool array: without it llama.cpp recomputes which blocks are
  recurrent from ``full_attention_interval`` and the shard's own block numbers
  (``src/models/qwen3next.cpp``: block ``i`` is recurrent unless ``(i + 1) % interval == 0``);
* MTP/nextn blocks (the last ``nextn_predict_layers`` blocks) are dropped: no shard serves them;
* ``glm-dsa``'s indexer types (which blocks have their own DSA lightning indexer) are written for the
  shard's range (llama.cpp defaults them from the shard's own block 0 otherwise), and a range must start
  at a full-indexer block (a shared one reuses the previous block's top-k, which cannot cross a cut);
* global tensors no block of the range loads are left out (llama.cpp refuses a file with an unused tensor): Gemma 4's
  ``rope_freqs``, which only its full-attention blocks use (``src/models/gemma4.cpp``);
* heuristics llama.cpp applies to the layer count are resolved from the whole model and written
  out, or the range is refused when llama.cpp cannot be told (Gemma 3 27B's attention scale);
* rules a graph computes from the block index (no-RoPE every 4th block, MoE every n-th) are checked to give the
  range's blocks what they get in the whole model, or the range is refused (``_same_flags``);
* a shard past block 0 gets ``embedding_scale`` 0 (``build_inp_embd`` scales ``batch.embd`` too,
  ``src/llama-graph.cpp``) and zeros for the learned positions the graph adds to its input (``ArchRules.embd_add``);
  a range must start at a block with attention heads where ``head_count`` is per block (llama.cpp reads the head
  sizes only when a file's block 0 has heads);
* an architecture whose graph misreads hidden-state input (scales or normalizes it as token embeddings, takes it
  for media, or needs more than one vector per token across a cut) runs only as the whole model, the reason naming
  the llama.cpp change that would lift it (``ArchRules.embd_input``, ``WHOLE_ONLY``).

``tests/zoo.py`` runs llama.cpp's architecture zoo (``tests/test-llama-archs``) through these rules: every
architecture with an entry is bitwise equal to llama.cpp's whole model as shard chains, or refused with its reason
(``docs/architectures.md``).

A shard without the head stage carries a one-token vocabulary (tokenizer model ``none``, a zero
one-row embedding and output): it receives hidden states through ``llama_batch.embd`` and never
sees token ids, so the 262144-row embedding and the LM head stay out of its memory. The
embedding lookup of the first shard runs in numpy (``embed_tokens``), which is bit-exact with
ggml's ``get_rows`` (both dequantize with ggml's block formats) plus the per-architecture input
scale llama.cpp applies to token input only (``ArchRules.token_scale``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from ...artifact.accounting import DEFAULT_SWA_PERIOD
from ...artifact.gguf_file import GGUFModelFile, dequantize_q8_0
from ..kv import TokenOutOfRange


class UnsupportedShard(ValueError):
    """The llama.cpp backend cannot run this architecture or this layer range; the message says why."""


@dataclass(frozen=True)
class ArchRules:
    """What llama.cpp derives from the absolute layer index or the layer count, for one architecture.

    ``swa_pattern``: llama.cpp's default sliding-window period when the GGUF has none (0: no SWA);
    ``swa_dense_first``: the pattern's first layer is the full-attention one; ``swa_array``: llama.cpp reads the
    sliding-window layers only from the per-layer ``attention.sliding_window_pattern`` array (no default period);
    ``leading_dense``: the model has ``leading_dense_block_count``; ``nextn``: it may carry MTP blocks;
    ``recurrent_interval``: hybrid recurrent model whose recurrent blocks llama.cpp derives from
    ``full_attention_interval`` (this is its default) when ``attention.recurrent_layers`` is absent (0: none);
    ``exact_states``: llama.cpp's cache for it cannot truncate a sequence partway whatever the range (the
    shard then truncates only to exact state checkpoints, as recurrent ones do);
    ``token_scale``: factor llama.cpp applies to token embeddings only (not to ``batch.embd``), as a
    function of ``n_embd``; ``check``: raises UnsupportedShard for ranges llama.cpp would misread,
    and may return extra metadata to write; ``embd_input``: set when the architecture's graph aborts
    on hidden-state input, which leaves only the whole model runnable (also where it misreads them: rescales or
    normalizes ``batch.embd`` as it does token embeddings, takes it for media, or needs more than one vector per
    token across a cut; the reason names the llama.cpp change that would lift it).
    ``swa_optional``: llama.cpp makes the model sliding-window only when ``attention.sliding_window`` > 0 and its graph
    treats full-attention blocks alike either way; a range holding no sliding-window block is written with
    ``sliding_window`` 0 (a plain KV cache) instead of being refused.
    ``recurrent``: ``model`` → per-block recurrent flags, where llama.cpp derives them from other per-layer
    hyperparameters (``head_count_kv`` 0: ``src/models/jamba.cpp`` and others) rather than ``full_attention_interval``.

    ``patch``: the patch of ggufswarm's llama.cpp patch queue (``patches/llama.cpp``) a layer range of this
    architecture needs (``llamacpp.patches``); its shards declare their input width as ``{arch}.embedding_length_in``,
    which that patched llama.cpp reads (the hidden states of the previous block, not media embeddings).
    ``streams``: the residual stream at a cut is this many ``n_embd`` vectors per token (DeepSeek-V4's
    hyper-connections: ``hyper_connection.count``; frames carry ``streams * n_embd`` values per token);
    ``token_ids``: the graph also reads each token's id with its hidden states (DeepSeek-V4's hash-routed blocks
    pick their experts from a token-id table), so every shard's batch carries both;
    ``tap``: the name llama.cpp's graph gives each block's output (``cb(cur, "l_out", il)``), captured at a cut;
    ``no_dummy_head``: the patched graph loads a shard without token embedding and output head (no one-row
    stand-ins written).
    ``embd_add``: global tensors the graph adds to its input whether tokens or ``batch.embd`` (learned absolute
    positions, ``position_embd``: ``inpL = ggml_add(inpL, ggml_get_rows(pos_embd, inp_pos))``, src/models/gpt2.cpp);
    a shard starting past block 0 carries zeros of their shape instead, its hidden states already hold them
    (``x + 0`` is ``x`` bit for bit).
    ``unused``: ``(model, a, b)`` → names of the model's global tensors llama.cpp does not load for blocks ``[a, b)``
    (it refuses a file with a tensor it did not use: "wrong number of tensors"), left out of that shard's file.
    """

    swa_pattern: int = 0
    swa_dense_first: bool = False
    swa_array: bool = False
    leading_dense: bool = False
    nextn: bool = False
    recurrent_interval: int = 0
    exact_states: bool = False
    token_scale: Callable[[int], np.float32] | None = None
    check: Callable[[GGUFModelFile, int, int], dict[str, Any]] | None = None
    embd_input: str | None = None  # why llama.cpp's graph refuses ``batch.embd`` (then: whole model only)
    patch: str | None = None
    streams: Callable[[dict], int] | None = None
    token_ids: bool = False
    tap: str = "l_out"
    no_dummy_head: bool = False
    embd_add: tuple[str, ...] = ()  # global tensors the graph adds to its input (zeros on a shard past block 0)
    unused: Callable[[GGUFModelFile, int, int], frozenset[str]] | None = None  # global tensors a range leaves out
    swa_optional: bool = False  # a range without sliding-window blocks runs as a plain (non-SWA) model
    recurrent: Callable[[GGUFModelFile], list[bool]] | None = None  # per-block recurrent flags (hybrid models)


def _gemma3_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    n = model.metadata["gemma3.block_count"]
    if n == 62 and (b - a) != n:  # src/models/gemma3.cpp: the 27B's attention scale is chosen by layer count
        raise UnsupportedShard("gemma3 with 62 blocks (27B): llama.cpp picks its attention scale from the "
                               "layer count, so a layer range of it would compute a different model")
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
        raise UnsupportedShard(f"deepseek2: a shard of {b - a} layers would be read as a 'lite' model by "
                               f"llama.cpp; choose a different range")
    if not md.get("deepseek2.expert_gating_func"):
        glm_lite = n_layer in (47, 48) and n_vocab == 154880
        extra["deepseek2.expert_gating_func"] = (2 if glm_lite else 1, GGUFValueType.UINT32)  # sigmoid : softmax
    return extra


def _hybrid_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    # src/llama-graph.cpp llm_graph_input_mem_hybrid::set_input fills the attention KV inputs and the recurrent
    # state-copy input unconditionally; a graph without an attention block (or without a recurrent one) never
    # allocates them and llama.cpp aborts on the first decode (GGML_ASSERT(buffer) in set_input_k_idxs)
    flags = recurrent_layers(model)[a:b]
    attention = _attention_layers(model)[a:b]
    if all(flags) or not any(flags) or not any(attention):
        kind = "recurrent" if not any(flags) else "full-attention"
        raise UnsupportedShard(f"{model.architecture}: layer range {a}:{b} has no {kind} block; llama.cpp's hybrid "
                               f"memory aborts on a graph without both kinds (llm_graph_input_mem_hybrid::set_input), "
                               f"so a shard must hold at least one recurrent and one full-attention block (a llama.cpp "
                               f"change would lift this: set_input skipping the attention inputs and the state-copy "
                               f"input when the graph did not allocate them)")
    return {}


def _attention_layers(model: GGUFModelFile) -> list[bool]:
    """Per-block flags of a hybrid model: the block attends (has a KV cache): ``head_count_kv`` > 0 where llama.cpp's
    loader derives the recurrent blocks from ``head_count_kv`` (``ArchRules.recurrent``), else every block that is
    not recurrent."""
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
        raise UnsupportedShard(f"glm-dsa: block {a} is a shared-indexer block (it reuses the top-k of full-indexer block "
                               f"{max((i for i in full if i < a), default=None)}, which llama.cpp cannot take across a cut: "
                               f"src/models/glm-dsa.cpp asserts prev_top_k); a layer range must start at a "
                               f"full-indexer block ({', '.join(map(str, full))})")
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
            f"the padding token's row and its own input instead, so only the whole model runs (layer range {a}:{b})")
    if int(md.get("gemma4.attention.shared_kv_layers", 0) or 0):
        raise UnsupportedShard(
            f"gemma4 with shared-KV layers (attention.shared_kv_layers > 0): its last blocks attend with the KV cache "
            f"of earlier blocks, which llama.cpp finds by counting from the shard's own layer count "
            f"(n_layer_kv_from_start), so only the whole model runs (layer range {a}:{b})")
    if b - a < 2:
        raise UnsupportedShard(
            f"gemma4: layer range {a}:{b} has one block; llama.cpp's KV cache for gemma4 asserts at least two KV "
            f"layers (src/llama-model.cpp create_memory: GGML_ASSERT(hparams.n_layer_kv_from_start >= 2)), which "
            f"would abort the node; a shard needs two blocks or more")
    return {}


def _gemma4_unused(model: GGUFModelFile, a: int, b: int) -> frozenset[str]:
    # src/models/gemma4.cpp load_arch_tensors: rope_freqs (the "proportional" RoPE's per-pair divisors) is created
    # for the full-attention blocks only; a range of sliding-window blocks alone never loads it
    swa = _swa_layers(model, ARCH_RULES["gemma4"])
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
    """UnsupportedShard unless ``flag(il, n_layer)``, a per-block rule llama.cpp computes from the block index ``il`` and
    the file's block count, gives blocks ``[a, b)`` of a shard file (``il`` from 0, ``n_layer = b - a``) what it gives
    them in the whole model."""
    n = n_model_layers(model)
    whole = [flag(il, n) for il in range(a, b)]
    local = [flag(il, b - a) for il in range(b - a)]
    if whole != local:
        raise UnsupportedShard(f"{model.architecture}: {what} counts from a file's block 0 ({source}), so a shard file of "
                               f"blocks {a}:{b} would get it wrong; choose a range that keeps it (a "
                               f"llama.cpp change reading it from a per-layer array would lift this)")


def _no_rope_every_4(source: str) -> Callable[[GGUFModelFile, int, int], dict[str, Any]]:
    """A check keeping the rule ``use_rope = (il + 1) % 4 != 0`` (every 4th block without RoPE, counted from the
    file's block 0; ``source``: where llama.cpp says so) right in a shard."""
    def check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
        _same_flags(model, a, b, "the no-RoPE block of every 4", lambda il, n: (il + 1) % 4 != 0, source)
        return {}
    return check


def _smallthinker_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    if int(model.metadata.get("smallthinker.attention.sliding_window", 0) or 0) > 0:
        _same_flags(model, a, b, "the no-RoPE block of every 4", lambda il, n: n == 4 or il % 4 != 0,
                    "src/models/smallthinker.cpp: use_rope = n_no_rope_layer_step == n_layer || il % "
                    "n_no_rope_layer_step != 0, a step of 4 with SWA")
    return {}


def _llama4_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    md = model.metadata
    step = int(md.get("llama4.interleave_moe_layer_step", 0) or 0)
    _same_flags(model, a, b, "the MoE block of every interleave_moe_layer_step", lambda il, n: step > 0 and (il + 1) % step == 0,
                "src/models/llama4.cpp: is_moe_layer = (i + 1) % n_moe_layer_step == 0")
    chunked = not ("llama4.attention.sliding_window" in md and int(md["llama4.attention.sliding_window"]) == 0)
    _same_flags(model, a, b, "the no-RoPE block", lambda il, n: (il + 1) % (4 if chunked else n) != 0,
                "src/models/llama4.cpp: use_rope = (il + 1) % n_no_rope_layer_step != 0, a step of 4 with chunked "
                "attention, else the layer count")
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
    raise UnsupportedShard(f"ernie4_5-moe: no interleave_moe_layer_step gives blocks {a}:{b} their MoE pattern "
                           f"(src/models/ernie4-5-moe.cpp: is_moe_layer = il >= lead && (il + 1) % step == 0)")


def _whole_layers_check(arch: str, n_whole: int, what: str) -> Callable[[GGUFModelFile, int, int], dict[str, Any]]:
    """A check refusing ranges of a model of ``n_whole`` blocks, where llama.cpp keys ``what`` on that block count."""
    def check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
        n = n_model_layers(model)
        if n == n_whole and b - a != n:
            raise UnsupportedShard(f"{arch} with {n} blocks: llama.cpp {what}, so a shard of {b - a} blocks would "
                                   f"compute a different model")
        return {}
    return check


def _command_r_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    n = n_model_layers(model)
    if n >= 64 and b - a < 64:  # src/models/command-r.cpp: if (n_layer >= 64) attn_q_norm, attn_k_norm
        raise UnsupportedShard(f"command-r with {n} blocks (Command R+): llama.cpp loads the per-head Q/K norms only "
                               f"for a file of 64 blocks or more (src/models/command-r.cpp), so a shard of {b - a} "
                               f"blocks would drop them")
    return {}


def _nanbeige_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    loops = int(model.metadata.get("nanbeige.num_loops", 1) or 1)
    if loops > 1 and (a, b) != (0, n_model_layers(model)):
        raise UnsupportedShard(f"nanbeige with num_loops {loops}: llama.cpp runs the file's blocks {loops} times over "
                               f"(src/models/nanbeige.cpp), a loop no layer range can cut")
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
        raise UnsupportedShard(f"{model.architecture}: its recurrent blocks take their head count from a file's block 0 "
                               f"(hparams.n_head(), src/models/{model.architecture}.cpp): block {a} has {heads[a]} heads, "
                               f"block 0 {heads[0]}, so a range must start at a block with {heads[0]}")
    return _hybrid_check(model, a, b)


def _minimax_m3_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    lead = int(model.metadata.get("minimax-m3.leading_dense_block_count", 0) or 0)
    if b <= lead:  # src/models/minimax-m3.cpp: is_sparse = msa_enabled && il >= n_layer_dense_lead
        raise UnsupportedShard(f"minimax-m3: layer range {a}:{b} holds only leading dense-attention blocks (0:{lead}); "
                               f"the graph creates its sparse-attention (MSA) inputs whenever flash attention is on, "
                               f"and llama.cpp aborts setting them when no block used them (llm_graph_input_msa::"
                               f"set_input, GGML_ASSERT(buffer)); a range needs a block from {lead} on (or a llama.cpp "
                               f"change creating the MSA inputs only for a graph with a sparse block)")
    return {}


def _dots3note_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    types = model.metadata.get("dots3note.attention.indexer.types")
    if isinstance(types, list) and not any(int(t) for t in types[a:b]):
        raise UnsupportedShard(f"dots3note: layer range {a}:{b} holds no block with a lightning indexer (its "
                               f"full-attention blocks: attention.indexer.types); the graph's DSA inputs are then never "
                               f"allocated and llama.cpp aborts setting them (GGML_ASSERT(buffer)); a range needs one "
                               f"(or a llama.cpp change skipping the indexer inputs of a graph without one)")
    return {}


def _kimi_k3_check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
    if int(model.metadata.get("kimi-k3.attn_res.block_size", 0) or 0) > 0:
        raise UnsupportedShard("kimi-k3 with attention residuals (attn_res.block_size > 0): every block mixes a bank of "
                               "earlier blocks' inputs (res_push / res_mix, src/models/kimi-k3.cpp), more than one "
                               "hidden state per token crosses a cut; only the whole model runs (a llama.cpp change "
                               "taking the bank through batch.embd, as 0002 does DeepSeek-V4's streams, would lift it)")
    return _hybrid_check(model, a, b)


def _checks(*checks: Callable[[GGUFModelFile, int, int], dict[str, Any]]) -> Callable[[GGUFModelFile, int, int], dict[str, Any]]:
    """One check running ``checks`` in turn (the extra metadata of all of them)."""
    def check(model: GGUFModelFile, a: int, b: int) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for c in checks:
            extra.update(c(model, a, b))
        return extra
    return check


# why a layer range of these cannot run (whole model only), from src/models/<arch>.cpp
_HYPER_CONNECTIONS = ("hyper-connections: hyper_connection.count residual streams cross a cut, and the graph takes "
                      "batch.embd as a token embedding to expand (src/models/{}.cpp); needs a llama.cpp change taking "
                      "the streams through batch.embd, as patch 0002 does for deepseek4")
WHOLE_ONLY: dict[str, str] = {
    "bloom": ("normalizes batch.embd with token_embd_norm as it does token embeddings (src/models/bloom.cpp), so a "
              "shard would normalize hidden states; needs a llama.cpp change skipping the input norm when "
              "embedding_length_in (patch 0001) is set"),
    "minicpm3": ("scales batch.embd by a fixed 12 as it scales token embeddings, and its residual scale is "
                 "1.4 / sqrt(n_layer) of the file's block count (src/models/minicpm3.cpp); needs a llama.cpp change "
                 "scaling token input only and reading residual_scale, as minicpm.cpp does"),
    "talkie": ("every block adds a learned multiple of the normalized input embedding (embd_skip, "
               "src/models/talkie.cpp), so two vectors per token cross a cut; needs a llama.cpp change taking the skip "
               "embedding as a second input"),
    "hrm_text": ("its blocks are cache slots of low/high stacks run in nested cycles (src/models/hrm-text.cpp asserts "
                 "block_count == layers_per_stack * h_cycles * (l_cycles + 1)); no block range is a part of the "
                 "computation"),
    "muse-glimmer": ("normalizes batch.embd (embd_norm: an RMS norm of the input, src/models/muse-glimmer.cpp) as it "
                     "does token embeddings, so a shard would normalize hidden states again; needs a llama.cpp change "
                     "normalizing token input only"),
    "minimax-01": ("its lightning-attention decay is scaled by 1 - il / (n_layer - 1) of the file's own block index "
                   "and count (src/models/minimax-01.cpp); needs a llama.cpp change reading the slope scale per layer"),
    "hy_v4": _HYPER_CONNECTIONS.format("hy-v4"),
    "glm5-next": _HYPER_CONNECTIONS.format("glm5-next"),
    "qwen4exp": _HYPER_CONNECTIONS.format("qwen4exp") + "; its per-layer n-gram embeddings also read token ids",
}


ARCH_RULES: dict[str, ArchRules] = {
    "llama": ArchRules(),
    "qwen2": ArchRules(),
    "qwen3": ArchRules(),
    "qwen2moe": ArchRules(),
    "qwen3moe": ArchRules(),
    "gemma3": ArchRules(swa_pattern=DEFAULT_SWA_PERIOD["gemma3"], token_scale=_sqrt_n_embd, check=_gemma3_check),
    # Gemma 1/2 and AFMoE scale token input by sqrt(n_embd) in the graph, and did the same to batch.embd until
    # patch 0003 (src/models/gemma.cpp, gemma2.cpp: pattern of 2, afmoe.cpp: pattern of 4 and a no-RoPE step of 4)
    "gemma": ArchRules(token_scale=_sqrt_n_embd, patch="0003-hidden-state-input"),
    "gemma2": ArchRules(swa_pattern=2, token_scale=_sqrt_n_embd, patch="0003-hidden-state-input"),
    "afmoe": ArchRules(swa_pattern=4, leading_dense=True, token_scale=_sqrt_n_embd, patch="0003-hidden-state-input",
                       check=_no_rope_every_4("src/models/afmoe.cpp: use_rope = (il + 1) % n_no_rope_layer_step "
                                              "!= 0, a step of 4 (src/llama-hparams.h default)")),
    # CogVLM: batch.embd ran through the vision-expert weights (image tokens) until patch 0003
    "cogvlm": ArchRules(patch="0003-hidden-state-input"),
    # Gemma 4 31B / 26B-A4B (src/models/gemma4.cpp): the per-layer sliding-window array, sqrt(n_embd) on token input,
    # rope_freqs on full-attention blocks only; E2B/E4B (per-layer embeddings, shared KV) run as the whole model
    "gemma4": ArchRules(swa_array=True, token_scale=_sqrt_n_embd, check=_gemma4_check, unused=_gemma4_unused),
    "deepseek": ArchRules(leading_dense=True),
    "deepseek2": ArchRules(leading_dense=True, nextn=True, check=_deepseek2_check),
    "glm4moe": ArchRules(leading_dense=True, nextn=True, patch="0003-hidden-state-input"),
    "gpt-oss": ArchRules(swa_pattern=DEFAULT_SWA_PERIOD["gpt-oss"]),
    "qwen3next": ArchRules(nextn=True, recurrent_interval=4, check=_hybrid_check),
    # IMRoPE: a hidden-state batch carries 4 positions per token (backend.LlamaCppShard.n_pos_per_token)
    "qwen35moe": ArchRules(nextn=True, recurrent_interval=4, check=_hybrid_check),
    "qwen35": ArchRules(nextn=True, recurrent_interval=4, check=_hybrid_check),
    "glm-dsa": ArchRules(leading_dense=True, nextn=True, check=_glm_dsa_check),
    # hc_mult residual streams cross a cut (frames of hc*n_embd per token), the hash-routed blocks read token ids,
    # the last block's output is named l_last (src/models/deepseek4.cpp)
    "deepseek4": ArchRules(nextn=True, exact_states=True, patch="0002-deepseek4-layer-range", streams=_hc_streams,
                           token_ids=True, tap="l_last", no_dummy_head=True, check=_deepseek4_check),
    # grown from llama.cpp's architecture zoo (tests/zoo.py, docs/architectures.md): each bitwise equal to llama.cpp's
    # whole model as shard chains; the rules from src/models/<arch>.cpp (load_arch_hparams, the graph)
    **{arch: ArchRules() for arch in (
        "arcee", "arctic", "baichuan", "chatglm", "codeshell", "dbrx", "deci", "ernie4_5", "exaone", "falcon",
        "gptneox", "grovemoe", "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2", "jais", "jais2",
        "maincoder", "minimax-m2", "mistral3", "nemotron", "olmo", "olmoe", "openelm", "orion", "paddleocr",
        "pangu-embedded", "phi2", "phi3", "phimoe", "plamo", "qwen", "qwen2vl", "refact", "seed_oss", "stablelm",
        "starcoder2", "xverse", "grok", "granitemoe")},
    # learned absolute positions added to the input (zeros past block 0: the hidden states hold them)
    **{arch: ArchRules(embd_add=("position_embd.weight",)) for arch in ("gpt2", "starcoder", "mpt")},
    # leading_dense_block_count read by the loader (src/models/<arch>.cpp)
    **{arch: ArchRules(leading_dense=True) for arch in (
        "bailingmoe", "bailingmoe2", "deepseek32", "dots1", "mistral4")},
    "minimax-m3": ArchRules(leading_dense=True, check=_minimax_m3_check),
    "ernie4_5-moe": ArchRules(leading_dense=True, check=_ernie45_moe_check),
    # GLM-4 aborts on embedding input of a text-only (non-M-RoPE) file unless patch 0003 (src/models/glm4.cpp), as glm4moe
    "glm4": ArchRules(patch="0003-hidden-state-input"),
    "command-r": ArchRules(check=_command_r_check),
    "exaone4": ArchRules(check=_whole_layers_check("exaone4", 64, "makes the 64-block model (32B) sliding-window "
                                                   "(src/models/exaone4.cpp: if (n_layer == 64))")),
    "nanbeige": ArchRules(check=_nanbeige_check),
    "smollm3": ArchRules(check=_no_rope_every_4("src/models/smollm3.cpp: n_no_rope_layer_step = 4, "
                                                "use_rope = (il + 1) % 4 != 0")),
    "minicpm": ArchRules(check=_minicpm_check),
    "granite": ArchRules(check=_deepstack_check),
    "qwen3vl": ArchRules(check=_deepstack_check),
    "qwen3vlmoe": ArchRules(check=_deepstack_check),
    # sliding-window models: the default period of load_swa_pattern (or the per-layer array llama.cpp requires)
    "cohere2": ArchRules(swa_pattern=4),
    "cohere2moe": ArchRules(swa_pattern=4, swa_dense_first=True, leading_dense=True),
    "exaone-moe": ArchRules(swa_pattern=4, leading_dense=True),
    "granite_swa": ArchRules(swa_array=True, check=_deepstack_check),
    "maple": ArchRules(swa_array=True),
    "mimo2": ArchRules(swa_array=True),
    "spark2_5": ArchRules(swa_array=True),
    "dots3note": ArchRules(swa_array=True, leading_dense=True, check=_dots3note_check),
    "smallthinker": ArchRules(swa_pattern=4, swa_dense_first=True, check=_smallthinker_check),
    "llama4": ArchRules(swa_pattern=4, check=_llama4_check),
    # sliding-window only when attention.sliding_window > 0, full-attention blocks computed alike either way
    "mellum": ArchRules(swa_pattern=4, swa_optional=True),
    "olmo2": ArchRules(swa_pattern=4, swa_optional=True),
    "plamo3": ArchRules(swa_pattern=8, swa_optional=True),
    "laguna": ArchRules(swa_pattern=4, swa_dense_first=True, swa_optional=True, leading_dense=True),
    # recurrent: every block (a fixed state per session; truncation only to exact state checkpoints)
    **{arch: ArchRules(recurrent=_all_recurrent) for arch in ("mamba", "mamba2", "falcon-h1")},
    # hybrid: recurrent blocks where head_count_kv is 0, and every shard needs one block of each kind
    **{arch: ArchRules(recurrent=_kv0_recurrent, check=_hybrid_check) for arch in ("jamba", "granitehybrid", "lfm2")},
    "plamo2": ArchRules(recurrent=_kv0_recurrent, check=_hybrid_check, tap="ffn_residual"),  # src/models/plamo2.cpp
    "lfm2moe": ArchRules(recurrent=_kv0_recurrent, check=_hybrid_check, leading_dense=True),
    **{arch: ArchRules(recurrent=_kv0_recurrent, check=_first_block_heads, leading_dense=True) for arch in (
        "kimi-linear", "bailingmoe3")},
    "kimi-k3": ArchRules(recurrent=_kv0_recurrent, check=_kimi_k3_check, leading_dense=True),
    # (src/models/nemotron-h.cpp names a block's output nemotron_h_block_out)
    **{arch: ArchRules(recurrent=_nemotron_h_recurrent, check=_hybrid_check, tap="nemotron_h_block_out") for arch in (
        "nemotron_h", "nemotron_h_moe")},
    # only the whole model (WHOLE_ONLY says why)
    **{arch: ArchRules(embd_input=why) for arch, why in WHOLE_ONLY.items()},
}


def rules_for(arch: str) -> ArchRules:
    """The ArchRules of ``arch``; UnsupportedShard naming the supported ones otherwise."""
    try:
        return ARCH_RULES[arch]
    except KeyError:
        from ...model import SUPPORTED as TORCH_ARCHS
        hint = "; --backend torch runs it" if arch in TORCH_ARCHS else ""
        raise UnsupportedShard(
            f"unsupported architecture '{arch}' for the llama.cpp backend (supported: "
            f"{', '.join(sorted(ARCH_RULES))}){hint}") from None


def n_model_layers(model: GGUFModelFile) -> int:
    """Blocks a route must cover: ``block_count`` less the MTP/nextn blocks (which no shard runs)."""
    arch = model.architecture
    return int(model.metadata[f"{arch}.block_count"]) - int(model.metadata.get(f"{arch}.nextn_predict_layers", 0))


def _swa_layers(model: GGUFModelFile, rules: ArchRules) -> list[bool] | None:
    """Per-layer sliding-window flags of the whole model, as llama.cpp computes them (None: no SWA)."""
    arch = model.architecture
    md = model.metadata
    if not (rules.swa_pattern or rules.swa_array) or not md.get(f"{arch}.attention.sliding_window"):
        return None
    n = int(md[f"{arch}.block_count"])
    key = f"{arch}.attention.sliding_window_pattern"
    value = md.get(key)
    if isinstance(value, list):
        return [bool(v) for v in value]
    if rules.swa_array:
        raise UnsupportedShard(f"{arch}: llama.cpp needs {key} as a per-layer array, and this file has "
                               f"{'none' if value is None else 'a scalar'}")
    period = int(value) if value is not None else rules.swa_pattern
    if rules.swa_dense_first:
        return [period == 0 or il % period != 0 for il in range(n)]
    return [period == 0 or il % period < period - 1 for il in range(n)]


def recurrent_layers(model: GGUFModelFile) -> list[bool] | None:
    """Per-block recurrent flags of the whole model as llama.cpp computes them (None: no recurrent blocks).
    ``ArchRules.recurrent`` where llama.cpp derives them from other hyperparameters (``head_count_kv`` 0:
    ``src/models/jamba.cpp``; every block: ``mamba.cpp``); else ``attention.recurrent_layers`` when the file has it,
    else from ``full_attention_interval`` (``src/models/qwen3next.cpp``: recurrent unless ``(i + 1) % interval == 0``;
    MTP blocks are not recurrent)."""
    arch = model.architecture
    rules = rules_for(arch)
    if rules.recurrent is not None:
        return rules.recurrent(model)
    if not rules.recurrent_interval:
        return None
    md = model.metadata
    n_all = int(md[f"{arch}.block_count"])
    flags = md.get(f"{arch}.attention.recurrent_layers")
    if isinstance(flags, list):
        return [bool(v) for v in flags]
    interval = int(md.get(f"{arch}.full_attention_interval", rules.recurrent_interval))
    n_layer = n_model_layers(model)
    return [il < n_layer and (il + 1) % interval != 0 for il in range(n_all)]


def shard_metadata(model: GGUFModelFile, start: int, end: int, head: bool) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """Metadata of the shard GGUF for blocks ``[start, end)``: key → (value, type, array item type).

    Raises UnsupportedShard for an architecture outside ``ARCH_RULES`` or a range llama.cpp cannot run.
    """
    arch = model.architecture
    rules = rules_for(arch)
    n_blocks = int(model.metadata[f"{arch}.block_count"])
    if not 0 <= start < end <= n_model_layers(model):
        raise UnsupportedShard(f"layer range {start}:{end} is outside the model's 0:{n_model_layers(model)}")
    whole = start == 0 and end == n_model_layers(model) and head
    if rules.embd_input and not whole:
        raise UnsupportedShard(f"{arch}: only the whole model runs on the llama.cpp backend: {rules.embd_input}")
    if rules.patch and not whole:
        from .patches import require_patch
        require_patch(rules.patch, f"a layer range of {arch}")
    extra = rules.check(model, start, end) if rules.check else {}
    heads = model.metadata.get(f"{arch}.attention.head_count")
    if isinstance(heads, list) and int(heads[start]) == 0 and int(heads[0]) > 0:
        raise UnsupportedShard(f"{arch}: block {start} has no attention heads, and llama.cpp reads the head sizes "
                               f"(attention.key_length, value_length, rope.dimension_count) only when a file's block 0 "
                               f"has some (src/llama-model.cpp load_hparams: if (hparams.n_head() > 0)); a layer range "
                               f"must start at a block with attention heads")
    out: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
    for key, value in model.metadata.items():
        vtype, item = model.metadata_types[key]
        if key.startswith("split."):
            continue
        if not head and key.startswith("tokenizer."):
            continue
        if (key.startswith(f"{arch}.") and isinstance(value, list) and len(value) == n_blocks
                and not key.endswith(".rope.dimension_sections")):  # (4 M-RoPE sections, whatever the block count)
            value = value[start:end]  # per-layer array
        out[key] = (value, vtype, item)
    out[f"{arch}.block_count"] = (end - start, GGUFValueType.UINT32, None)
    if rules.patch and not whole:  # the patched llama.cpp: this shard takes hidden states of this width
        out[f"{arch}.embedding_length_in"] = (hidden_width(model), GGUFValueType.UINT32, None)
    if rules.nextn or f"{arch}.nextn_predict_layers" in model.metadata:  # (MTP blocks are never in a shard)
        out[f"{arch}.nextn_predict_layers"] = (0, GGUFValueType.UINT32, None)
    if start > 0:
        # src/llama-graph.cpp build_inp_embd scales batch.embd too by hparams.f_embedding_scale (a model without
        # deepstack layers): the hidden states of block start-1 must not be scaled again. 0 turns the scale off, also
        # where the loader has a default for an absent key (grok 78.38, minicpm 12: src/models/grok.cpp, minicpm.cpp)
        out[f"{arch}.embedding_scale"] = (0.0, GGUFValueType.FLOAT32, None)
    if rules.leading_dense and f"{arch}.leading_dense_block_count" in model.metadata:
        lead = int(model.metadata[f"{arch}.leading_dense_block_count"])
        out[f"{arch}.leading_dense_block_count"] = (max(0, lead - start), GGUFValueType.UINT32, None)
    swa = _swa_layers(model, rules)
    if swa is not None and any(swa) and not any(swa[start:end]):
        if not rules.swa_optional:
            raise UnsupportedShard(f"{arch}: layer range {start}:{end} holds no sliding-window layer, and llama.cpp's "
                                   f"memory for a model with sliding-window attention asserts one (src/llama-model.cpp "
                                   f"create_memory: is_swa_any); widen the range (sliding-window layers: "
                                   f"{', '.join(str(i) for i, w in enumerate(swa) if w)}), or a llama.cpp change: "
                                   f"create_memory building a plain KV cache when no block is sliding-window")
        # llama.cpp then builds a plain model (a plain KV cache): the range's full-attention blocks compute as in the
        # whole model
        out[f"{arch}.attention.sliding_window"] = (0, GGUFValueType.UINT32, None)
    if swa is not None:
        out[f"{arch}.attention.sliding_window_pattern"] = (swa[start:end], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    recr = recurrent_layers(model)
    if recr is not None:
        out[f"{arch}.attention.recurrent_layers"] = (recr[start:end], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    for key, (value, vtype) in extra.items():
        out[key] = (value, vtype, GGUFValueType.UINT32 if vtype == GGUFValueType.ARRAY else None)
    if not head:
        out["tokenizer.ggml.model"] = ("none", GGUFValueType.STRING, None)
        # a graph that reads token ids (hash routing) checks them against the vocabulary size: keep the real one
        out[f"{arch}.vocab_size"] = (n_vocab(model) if rules.token_ids else 1, GGUFValueType.UINT32, None)
    return out


def n_vocab(model: GGUFModelFile) -> int:
    """Vocabulary size of the whole model (rows of ``token_embd``, else ``vocab_size`` or the token list)."""
    if "token_embd.weight" in model.tensors:
        return int(model.tensors["token_embd.weight"].shape[0])
    md = model.metadata
    return int(md.get(f"{model.architecture}.vocab_size") or len(md.get("tokenizer.ggml.tokens", [])))


def hidden_width(model: GGUFModelFile) -> int:
    """Values per token of the hidden state crossing a cut between two shards: ``n_embd``, or ``streams x n_embd``
    where the architecture widens its residual stream (DeepSeek-V4: ``hyper_connection.count`` = 4 streams)."""
    rules = rules_for(model.architecture)
    n_embd = int(model.metadata[f"{model.architecture}.embedding_length"])
    return n_embd * (rules.streams(model.metadata) if rules.streams else 1)


def _tensor_source(model: GGUFModelFile, name: str) -> np.ndarray:
    """The raw bytes of tensor ``name`` as a read-only memory map (uint8 ``[n_bytes]``), read lazily."""
    info = model.tensors[name]
    return np.memmap(info.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.n_bytes,))


def shard_tensors(model: GGUFModelFile, start: int, end: int, head: bool) -> list[tuple[str, str]]:
    """The tensors of the shard of blocks ``[start, end)``: ``(name in the model, name in the shard)`` pairs, in the
    model's order. Blocks are renumbered from 0 (``blk.{i}`` → ``blk.{i - start}``), MTP/nextn blocks dropped; the
    token embedding, output norm and LM head only with ``head`` (and not the embedding where a patched graph
    taking hidden states needs none: ``ArchRules.no_dummy_head``); other global tensors (e.g. ``rope_freqs``) on
    every shard, except those the range does not load (``ArchRules.unused``)."""
    rules = rules_for(model.architecture)
    n_layer = n_model_layers(model)
    unused = rules.unused(model, start, end) if rules.unused else frozenset()
    out = []
    for name, info in model.tensors.items():
        layer = info.layer
        if layer is not None:
            if not start <= layer < end or layer >= n_layer:
                continue
            new_name = f"blk.{layer - start}.{name.split('.', 2)[2]}"
        elif name in rules.embd_add and start > 0:
            continue  # a zero stand-in (_stand_ins): the hidden states coming in already hold it
        elif name in ("token_embd.weight", "output.weight", "output.bias", "output_norm.weight"):
            if not head or (rules.no_dummy_head and name == "token_embd.weight" and not (start == 0 and end == n_layer)):
                continue  # (a patched graph taking hidden states needs no token embedding)
            new_name = name
        elif name.startswith("output_") and rules.no_dummy_head and not head:
            continue  # the rest of the output head (DeepSeek-V4's output_hc_*)
        elif name in unused:
            continue  # a global tensor no block of this range loads (Gemma 4's rope_freqs: full-attention blocks only)
        else:
            new_name = name  # global tensors a block may use (e.g. rope_freqs)
        out.append((name, new_name))
    return out


def _stand_ins(model: GGUFModelFile, head: bool, start: int = 0) -> list[tuple[str, np.ndarray]]:
    """Tensors a shard carries in place of the model's: a shard without the head stage, a one-row token embedding and
    LM head (and bias) and a unit output norm, those of them the model has (its vocabulary is one token; llama.cpp's
    loader requires the tensors, and refuses a file with a tensor it does not use); a shard starting past block 0,
    zeros of the model's shape for the tensors the graph adds to its input (``ArchRules.embd_add``, f16)."""
    arch = model.architecture
    rules = rules_for(arch)
    out = [(name, np.zeros(model.tensors[name].shape, np.float16))
           for name in rules.embd_add if start > 0 and name in model.tensors]
    if head or rules.no_dummy_head:
        return out
    n_embd = int(model.metadata[f"{arch}.embedding_length"])
    stand = {"token_embd.weight": np.zeros((1, n_embd), np.float32),
             "output.weight": np.zeros((1, n_embd), np.float32),
             "output.bias": np.zeros(1, np.float32),
             "output_norm.weight": np.ones(n_embd, np.float32)}
    return [(name, array) for name, array in stand.items()
            if name == "token_embd.weight" or name in model.tensors] + out


def _write_gguf(model: GGUFModelFile, dest: Path, metadata: dict, tensors: list[tuple[str, str]],
                arrays: list[tuple[str, np.ndarray]]) -> Path:
    """Write a GGUF with ``metadata``, the raw bytes of ``tensors`` (``(model name, new name)``, read from ``model``)
    and ``arrays``, to a temporary name renamed to ``dest`` (a crash never leaves a half file behind)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), model.architecture)
    writer.kv_data[0].clear()  # GGUFWriter pre-adds general.architecture; we copy every key in order
    for key, (value, vtype, item) in metadata.items():
        if vtype == GGUFValueType.ARRAY and len(value) == 0:
            continue  # gguf-py cannot write an empty array; llama.cpp reads an absent optional array as empty
        writer.add_key_value(key, value, vtype, sub_type=item)
    for name, new_name in tensors:
        info = model.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)  # the writer takes raw bytes' shape
        writer.add_tensor(new_name, _tensor_source(model, name), raw_shape=byte_shape, raw_dtype=info.ggml_type)
    for name, array in arrays:
        writer.add_tensor(name, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def derive_shard(model: GGUFModelFile, start: int, end: int, head: bool, dest: str | os.PathLike) -> Path:
    """Write the shard GGUF of blocks ``[start, end)`` (plus output norm and LM head when ``head``) to ``dest``: a
    copy of the shard's tensors (``shard_tensors``) with the shard's metadata (``shard_metadata``).

    Reads only the shard's tensors (and the header) from ``model``, so a sparse swarm-fetched file
    works. Written to a temporary name and renamed, so a crash never leaves a half file behind.
    Raises UnsupportedShard as ``shard_metadata``; OSError on a write failure.
    """
    metadata = shard_metadata(model, start, end, head)
    return _write_gguf(model, Path(dest), metadata, shard_tensors(model, start, end, head), _stand_ins(model, head, start))


def derive_shard_header(model: GGUFModelFile, start: int, end: int, head: bool, dest: str | os.PathLike) -> Path:
    """Write the *header* of the shard of blocks ``[start, end)`` to ``dest``: the shard's metadata and stand-in
    tensors only (kilobytes to a few MB: the tokenizer), the weights staying in the model file(s) the node fetched.

    llama.cpp with patch 0004 (``split.sources.*``) loads it as the first file of a split set whose other files are
    the model's own (``llama_model_load_from_splits([dest, *model.paths])``): it takes the tensors named in
    ``split.sources.tensors`` from them in place, blocks renumbered down by ``split.sources.block_offset``, and
    skips the rest. One copy of the layers on disk: the bytes the node fetched, which it also seeds.
    Raises UnsupportedShard as ``shard_metadata``; OSError on a write failure.
    """
    tensors = shard_tensors(model, start, end, head)
    stand_ins = _stand_ins(model, head, start)
    metadata = shard_metadata(model, start, end, head)
    metadata.update({
        "split.no": (0, GGUFValueType.UINT16, None),
        "split.count": (1 + len(model.paths), GGUFValueType.UINT16, None),
        "split.tensors.count": (len(tensors) + len(stand_ins), GGUFValueType.INT32, None),
        "split.sources.tensors": ([name for name, _ in tensors], GGUFValueType.ARRAY, GGUFValueType.STRING),
        "split.sources.block_offset": (start, GGUFValueType.UINT32, None),
    })
    return _write_gguf(model, Path(dest), metadata, [], stand_ins)


class TokenEmbedding:
    """The embedding stage in numpy: token ids → the hidden states llama.cpp's first block receives.

    Bit-exact with ggml's ``get_rows`` on the (quantized) ``token_embd`` tensor followed by the
    architecture's token-input scale (``ArchRules.token_scale``; Gemma: ``sqrtf(n_embd)``,
    ``src/models/gemma3.cpp``). Only the rows asked for are read (memory-mapped).
    """

    def __init__(self, model: GGUFModelFile):
        info = model.tensors["token_embd.weight"]
        self.n_vocab, self.n_embd = info.shape
        self.qtype = info.ggml_type
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        self.row_bytes = self.n_embd // block * type_size
        self.rows = _tensor_source(model, "token_embd.weight").reshape(self.n_vocab, self.row_bytes)
        rules = rules_for(model.architecture)
        self.scale = rules.token_scale(self.n_embd) if rules.token_scale else None

    def __call__(self, token_ids: np.ndarray) -> np.ndarray:
        """int ids ``[T]`` → float32 ``[T, n_embd]``; TokenOutOfRange for an id outside ``[0, n_vocab)``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            raise TokenOutOfRange(f"token id out of range [0, {self.n_vocab})")
        raw = np.ascontiguousarray(self.rows[ids])
        if self.qtype == GGMLQuantizationType.F32:
            x = raw.view(np.float32).reshape(len(ids), self.n_embd)
        elif self.qtype == GGMLQuantizationType.F16:
            x = raw.view(np.float16).astype(np.float32).reshape(len(ids), self.n_embd)
        elif self.qtype == GGMLQuantizationType.Q8_0:
            x = dequantize_q8_0(raw.reshape(-1)).reshape(len(ids), self.n_embd)
        else:
            x = dequantize(raw, self.qtype).astype(np.float32, copy=False).reshape(len(ids), self.n_embd)
        if self.scale is not None:
            x = x * self.scale
        return np.ascontiguousarray(x, dtype=np.float32)


def shard_file_name(model: GGUFModelFile, start: int, end: int, head: bool) -> str:
    """A name that identifies the derived file: model fingerprint, range, head stage, format version."""
    return f"{model.fingerprint[:16]}-{start}-{end}{'-head' if head else ''}-v2.gguf"


def shard_paths(model: GGUFModelFile, start: int, end: int, head: bool, cache_dir: str | os.PathLike,
                in_place: bool | None = None) -> list[Path]:
    """The files llama.cpp loads for the shard ``[start, end)``, derived under ``cache_dir`` on first use.

    The whole model with its head (``start == 0``, ``end == n_layers``, no MTP blocks, one file) is the original file
    itself. Otherwise, ``in_place`` (default: when the loaded libllama carries patch 0004): the shard's header
    (``derive_shard_header``) followed by the model's own files, which llama.cpp reads the shard's tensors from in
    place; else one derived shard GGUF holding a copy of them (``derive_shard``).
    """
    if start == 0 and end == n_model_layers(model) and head and n_model_layers(model) == int(
            model.metadata[f"{model.architecture}.block_count"]) and len(model.paths) == 1:
        rules_for(model.architecture)
        return [model.path]
    if in_place is None:
        from .patches import applied
        in_place = applied("0004-split-sources")
    name = shard_file_name(model, start, end, head)
    if in_place:
        path = Path(cache_dir) / name.replace(".gguf", "-header.gguf")
        if not path.exists():
            derive_shard_header(model, start, end, head, path)
        return [path, *[Path(p) for p in model.paths]]
    path = Path(cache_dir) / name
    if not path.exists():
        derive_shard(model, start, end, head, path)
    return [path]


__all__ = ["ARCH_RULES", "ArchRules", "TokenEmbedding", "UnsupportedShard", "derive_shard", "derive_shard_header",
           "hidden_width", "shard_paths", "shard_tensors",
           "n_model_layers", "n_vocab",
           "rules_for", "shard_metadata"]
