"""The per-architecture range checks of ``cut_rules``: why blocks ``[a, b)`` of a model cannot be one llama.cpp shard
(a reason, or None), from the GGUF header alone (the rules a graph computes from the block index or the layer count,
per ``src/models/<arch>.cpp``), and the per-block flags some architectures derive. ``cut_rules.CUT_RULES`` names the
check of each architecture; each takes a ``cut_rules.Header``. docs/design.md, "A llama.cpp shard file".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cut_rules import Header

Check = Callable[["Header", int, int], "str | None"]


def per_layer(md: dict, key: str, n: int, default: int = 0) -> list[int]:
    """A hyperparameter llama.cpp reads with ``get_key_or_arr`` (one value, or one per block) as ``n`` values."""
    value = md.get(key, default)
    return [int(v) for v in value[:n]] if isinstance(value, list) else [int(value)] * n


def n_head_kv(h: Header) -> list[int]:
    """KV heads of every block (``attention.head_count_kv``, one value or one per block; ``head_count`` without it)."""
    key = f"{h.arch}.attention.head_count_kv"
    return per_layer(h.md, key if key in h.md else f"{h.arch}.attention.head_count", h.n_blocks)


def all_recurrent(h: Header) -> list[bool]:
    """Every trunk block recurrent (Mamba, Mamba-2; Falcon-H1, whose every block runs an SSM beside its attention)."""
    return [il < h.n_layers for il in range(h.n_blocks)]


def kv0_recurrent(h: Header) -> list[bool]:
    """A block is recurrent where its ``head_count_kv`` is 0 (``src/models/jamba.cpp``, ``granite-hybrid.cpp``,
    ``plamo2.cpp``, ``lfm2.cpp``, ``lfm2moe.cpp``, ``kimi-linear.cpp``, ``bailingmoe3.cpp``: ``is_recr_impl[i] =
    n_head_kv(i) == 0``); MTP blocks are not."""
    kv = n_head_kv(h)
    return [il < h.n_layers and kv[il] == 0 for il in range(h.n_blocks)]


def nemotron_h_recurrent(h: Header) -> list[bool]:
    """``src/models/nemotron-h.cpp``: a Mamba-2 block has neither KV heads nor a feed-forward (``n_head_kv(i) == 0 &&
    n_ff(i) == 0``); the others are attention blocks (KV heads) or MLP-only blocks."""
    kv = n_head_kv(h)
    ff = per_layer(h.md, f"{h.arch}.feed_forward_length", h.n_blocks)
    return [il < h.n_layers and kv[il] == 0 and ff[il] == 0 for il in range(h.n_blocks)]


def gemma3_check(h: Header, a: int, b: int) -> str | None:
    if h.n_blocks == 62 and (b - a) != h.n_blocks:  # src/models/gemma3.cpp: the 27B's attention scale by layer count
        return (
            "gemma3 with 62 blocks (27B): llama.cpp picks its attention scale from the "
            "layer count, so a layer range of it would compute a different model"
        )
    return None


def deepseek2_lite(h: Header, n: int) -> bool:
    """Whether llama.cpp reads a ``deepseek2`` file of ``n`` layers as a "lite" model (no q_lora_rank), from the layer
    count and the vocabulary size (``src/models/deepseek2.cpp``)."""
    n_vocab = h.md.get("deepseek2.vocab_size") or len(h.md.get("tokenizer.ggml.tokens", []))
    return n in (26, 27) or (n == 48 and n_vocab == 128256)


def deepseek2_check(h: Header, a: int, b: int) -> str | None:
    if deepseek2_lite(h, b - a) and not deepseek2_lite(h, h.n_layers):
        return (
            f"deepseek2: a shard of {b - a} layers would be read as a 'lite' model by "
            f"llama.cpp; choose a different range"
        )
    return None


class OneKindProblem(str):
    """A check's reason that holds only for a llama.cpp without patch ``cut_rules.ONE_KIND_PATCH`` (a range of one
    kind of block: ``range_problem`` passes it over where the patch is there)."""


class IndexerProblem(str):
    """A check's reason that holds only for a llama.cpp without patch ``cut_rules.INDEXER_PATCH`` (a range of a DSA
    model without a block whose indexer inputs the graph sets: ``range_problem`` passes it over where the patch is
    there); ``rest``: the check's reason with the patch (None: none)."""

    rest: str | None = None


class PatternProblem(str):
    """A check's reason that holds only for a llama.cpp without patch ``cut_rules.PATTERN_PATCH`` (a per-block rule
    llama.cpp counts from a file's block 0 that a range would get wrong: ``range_problem`` passes it over where the
    patch is there, whose graphs count from the whole model's block 0, ``block_offset``)."""


def indexer_problem(text: str, rest: str | None = None) -> IndexerProblem:
    """An ``IndexerProblem`` saying ``text``, ``rest`` where the patch is there."""
    problem = IndexerProblem(text)
    problem.rest = rest
    return problem


def hybrid_check(h: Header, a: int, b: int) -> str | None:
    # src/llama-graph.cpp llm_graph_input_mem_hybrid::set_input fills the attention KV inputs and the recurrent
    # state-copy input unconditionally; a graph without an attention block (or without a recurrent one) never
    # allocates them and llama.cpp aborts on the first decode (GGML_ASSERT(buffer) in set_input_k_idxs), unless
    # patch 0011-one-kind-layer-ranges skips the inputs the graph did not allocate
    flags = (h.recurrent or [False] * h.n_blocks)[a:b]
    attention = h.attention[a:b]
    if all(flags) or not any(flags) or not any(attention):
        kind = "recurrent" if not any(flags) else "full-attention"
        return OneKindProblem(
            f"{h.arch}: layer range {a}:{b} has no {kind} block; llama.cpp's hybrid "
            f"memory aborts on a graph without both kinds (llm_graph_input_mem_hybrid::set_input) "
            f"without patch 0011-one-kind-layer-ranges (patches/llama.cpp in ggufswarm; `make setup` "
            f"builds it), so a shard must hold at least one recurrent and one full-attention block"
        )
    return None


# src/models/glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES: 1, 1, then 1, 0, 0, 0 repeated (1: the block has its own
# lightning indexer, 0: it reuses the top-k of the last full one); used when the file has no
# attention.indexer.types and a trained context of at least 1M (GLM-5.2); shorter contexts: every block full
_GLM_DSA_DEFAULT_PERIOD = (1, 0, 0, 0)


def glm_dsa_indexer_types(h: Header) -> list[int]:
    """Per-block indexer types (1 full, 0 shared) of a ``glm-dsa`` model's ``n_layer`` trunk blocks, as llama.cpp's
    loader reads or defaults them (``src/models/glm-dsa.cpp`` load_arch_hparams)."""
    n = h.n_layers
    types = h.md.get("glm-dsa.attention.indexer.types")
    if isinstance(types, list):
        return [int(t) for t in types][:n]
    if int(h.md.get("glm-dsa.context_length", 0)) < 1048576:  # "BC for GLM 5, 5.1 (full indexers)"
        return [1] * n
    return ([1, 1] + list(_GLM_DSA_DEFAULT_PERIOD) * (n // 4 + 1))[:n]


def glm_dsa_check(h: Header, a: int, b: int) -> str | None:
    types = glm_dsa_indexer_types(h)
    if not types[a]:
        full = [i for i, t in enumerate(types) if t]
        return (
            f"glm-dsa: block {a} is a shared-indexer block (it reuses the top-k of full-indexer block "
            f"{max((i for i in full if i < a), default=None)}, which llama.cpp cannot take across a cut: "
            f"src/models/glm-dsa.cpp asserts prev_top_k); a layer range must start at a "
            f"full-indexer block ({', '.join(map(str, full))})"
        )
    return None


def gemma4_check(h: Header, a: int, b: int) -> str | None:
    # src/models/gemma4.cpp; the layer-count switch in load_arch_hparams only names the model type (no number
    # depends on it) and f_attention_scale is fixed at 1.0, so a dense range needs nothing written
    md = h.md
    if (a, b) == (0, h.n_layers):
        return None  # the whole model: llama.cpp's own graph from token ids
    if int(md.get("gemma4.embedding_length_per_layer_input", 0) or 0):
        return (
            f"gemma4 with per-layer token embeddings (E2B/E4B: embedding_length_per_layer_input > 0): llama.cpp "
            f"computes every block's per-layer input at the start of the graph from the token ids and the first "
            f"block's input (build_inp_per_layer / project_per_layer_inputs); a shard given hidden states would use "
            f"the padding token's row and its own input instead, so only the whole model runs (layer range {a}:{b})"
        )
    if int(md.get("gemma4.attention.shared_kv_layers", 0) or 0):
        return (
            f"gemma4 with shared-KV layers (attention.shared_kv_layers > 0): its last blocks attend with the KV cache "
            f"of earlier blocks, which llama.cpp finds by counting from the shard's own layer count "
            f"(n_layer_kv_from_start), so only the whole model runs (layer range {a}:{b})"
        )
    if b - a < 2:
        return (
            f"gemma4: layer range {a}:{b} has one block; llama.cpp's KV cache for gemma4 asserts at least two KV "
            f"layers (src/llama-model.cpp create_memory: GGML_ASSERT(hparams.n_layer_kv_from_start >= 2)), which "
            f"would abort the node; a shard needs two blocks or more"
        )
    return None


def same_flags(h: Header, a: int, b: int, what: str, flag: Callable[[int, int], bool], source: str) -> str | None:
    """A reason (a ``PatternProblem``) unless ``flag(il, n_layer)``, a per-block rule llama.cpp computes from the block
    index ``il`` and the file's block count, gives blocks ``[a, b)`` of a shard file (``il`` from 0, ``n_layer = b -
    a``) what it gives them in the whole model."""
    whole = [flag(il, h.n_layers) for il in range(a, b)]
    local = [flag(il, b - a) for il in range(b - a)]
    if whole != local:
        return PatternProblem(
            f"{h.arch}: {what} counts from a file's block 0 ({source}), so a shard file of "
            f"blocks {a}:{b} would get it wrong without patch 0020-block-patterns-of-the-whole-model "
            f"(patches/llama.cpp in ggufswarm; `make setup` builds it); choose a range that keeps it"
        )
    return None


def no_rope_every_4(source: str) -> Check:
    """A check keeping the rule ``use_rope = (il + 1) % 4 != 0`` (every 4th block without RoPE, counted from the
    file's block 0; ``source``: where llama.cpp says so) right in a shard."""

    def check(h: Header, a: int, b: int) -> str | None:
        return same_flags(h, a, b, "the no-RoPE block of every 4", lambda il, n: (il + 1) % 4 != 0, source)

    return check


def llama4_check(h: Header, a: int, b: int) -> str | None:
    md = h.md
    step = int(md.get("llama4.interleave_moe_layer_step", 0) or 0)
    chunked = not ("llama4.attention.sliding_window" in md and int(md["llama4.attention.sliding_window"]) == 0)
    return same_flags(
        h,
        a,
        b,
        "the MoE block of every interleave_moe_layer_step",
        lambda il, n: step > 0 and (il + 1) % step == 0,
        "src/models/llama4.cpp: is_moe_layer = (i + 1) % n_moe_layer_step == 0",
    ) or same_flags(
        h,
        a,
        b,
        "the no-RoPE block",
        lambda il, n: (il + 1) % (4 if chunked else n) != 0,
        "src/models/llama4.cpp: use_rope = (il + 1) % n_no_rope_layer_step != 0, a step of 4 with chunked "
        "attention, else the layer count",
    )


def ernie45_moe_step(h: Header, a: int, b: int) -> int | None:
    """The ``interleave_moe_layer_step`` that gives an ``ernie4_5-moe`` shard of blocks ``[a, b)`` their MoE pattern
    (None: none does). src/models/ernie4-5.cpp loads expert tensors for il >= leading_dense_block_count, and
    ernie4-5-moe.cpp runs them where also (il + 1) % interleave_moe_layer_step == 0."""
    lead = int(h.md.get("ernie4_5-moe.leading_dense_block_count", 0) or 0)
    step = int(h.md["ernie4_5-moe.interleave_moe_layer_step"])
    moe = [il >= lead and (il + 1) % step == 0 for il in range(a, b)]
    lead2 = max(0, lead - a)
    for s in range(1, b - a + 2):
        if all(m == (il >= lead2 and (il + 1) % s == 0) for il, m in enumerate(moe)):
            return s
    return None


def ernie45_moe_check(h: Header, a: int, b: int) -> str | None:
    if ernie45_moe_step(h, a, b) is None:
        return PatternProblem(
            f"ernie4_5-moe: no interleave_moe_layer_step gives blocks {a}:{b} their MoE pattern "
            f"(src/models/ernie4-5-moe.cpp: is_moe_layer = il >= lead && (il + 1) % step == 0) without patch "
            f"0020-block-patterns-of-the-whole-model (patches/llama.cpp in ggufswarm; `make setup` builds it)"
        )
    return None


def whole_layers_check(arch: str, n_whole: int, what: str) -> Check:
    """A check refusing ranges of a model of ``n_whole`` blocks, where llama.cpp keys ``what`` on that block count."""

    def check(h: Header, a: int, b: int) -> str | None:
        n = h.n_layers
        if n == n_whole and b - a != n:
            return (
                f"{arch} with {n} blocks: llama.cpp {what}, so a shard of {b - a} blocks would "
                f"compute a different model"
            )
        return None

    return check


def command_r_check(h: Header, a: int, b: int) -> str | None:
    n = h.n_layers
    if n >= 64 and b - a < 64:  # src/models/command-r.cpp: if (n_layer >= 64) attn_q_norm, attn_k_norm
        return (
            f"command-r with {n} blocks (Command R+): llama.cpp loads the per-head Q/K norms only "
            f"for a file of 64 blocks or more (src/models/command-r.cpp), so a shard of {b - a} "
            f"blocks would drop them"
        )
    return None


def nanbeige_check(h: Header, a: int, b: int) -> str | None:
    loops = int(h.md.get("nanbeige.num_loops", 1) or 1)
    if loops > 1 and (a, b) != (0, h.n_layers):
        return (
            f"nanbeige with num_loops {loops}: llama.cpp runs the file's blocks {loops} times over "
            f"(src/models/nanbeige.cpp), a loop no layer range can cut"
        )
    return None


def first_block_heads(h: Header, a: int, b: int) -> str | None:
    # src/models/kimi-linear.cpp, bailingmoe3.cpp, kimi-k3.cpp: the recurrent (KDA) blocks take their head count from
    # hparams.n_head(), the file's block 0; a range starting at a KDA block (0 heads in a per-layer head_count) is
    # given the whole model's block-0 count (runtime/llamacpp/range_checks.py, _recurrent_heads_check), one starting
    # at an attention block with another count cannot be
    heads = h.md.get(f"{h.arch}.attention.head_count")
    if isinstance(heads, list) and int(heads[a]) not in (0, int(heads[0])):
        return (
            f"{h.arch}: its recurrent blocks take their head count from a file's block 0 "
            f"(hparams.n_head(), src/models/{h.arch}.cpp): block {a} has {heads[a]} heads, "
            f"block 0 {heads[0]}, so a range must start at a block with {heads[0]} or a recurrent one"
        )
    return hybrid_check(h, a, b)


def minimax_m3_check(h: Header, a: int, b: int) -> str | None:
    lead = int(h.md.get("minimax-m3.leading_dense_block_count", 0) or 0)
    if b <= lead:  # src/models/minimax-m3.cpp: is_sparse = msa_enabled && il >= n_layer_dense_lead
        return indexer_problem(
            f"minimax-m3: layer range {a}:{b} holds only leading dense-attention blocks (0:{lead}); "
            f"the graph creates its sparse-attention (MSA) inputs whenever flash attention is on, "
            f"and llama.cpp aborts setting them when no block used them (llm_graph_input_msa::"
            f"set_input, GGML_ASSERT(buffer)) without patch 0017-indexer-free-ranges (patches/llama.cpp in "
            f"ggufswarm; `make setup` builds it), so a range needs a block from {lead} on"
        )
    return None


def dots3note_check(h: Header, a: int, b: int) -> str | None:
    types = h.md.get("dots3note.attention.indexer.types")
    if isinstance(types, list) and not any(int(t) for t in types[a:b]):
        return indexer_problem(
            f"dots3note: layer range {a}:{b} holds no block with a lightning indexer (its "
            f"full-attention blocks: attention.indexer.types); the graph's DSA inputs are then never "
            f"allocated and llama.cpp aborts setting them (GGML_ASSERT(buffer)) without patch "
            f"0017-indexer-free-ranges (patches/llama.cpp in ggufswarm; `make setup` builds it), so a range "
            f"needs one"
        )
    return None


def shared_indexer_check(default_full: int) -> Check:
    """The check of a model whose DSA blocks may reuse the indexer top-k of an earlier block (``attention.indexer.
    types``: 1 full, 0 shared; ``default_full``: llama.cpp's value for a file without the key): the first attention
    block of a range must compute its own top-k (src/models/hy-v4.cpp ``GGML_ASSERT(*last_top_k != nullptr)``,
    glm5-next.cpp ``"shared indexer layer must follow a full indexer layer"``), and a range of a model with indexers
    needs an attention block; a hybrid's range is also checked by ``hybrid_check``."""

    def check(h: Header, a: int, b: int) -> str | None:
        if int(h.md.get(f"{h.arch}.attention.indexer.top_k", 0) or 0) > 0:
            types = per_layer(h.md, f"{h.arch}.attention.indexer.types", h.n_blocks, default_full)
            recurrent = h.recurrent or [False] * h.n_blocks
            first = next((il for il in range(a, b) if not recurrent[il]), None)
            if first is None:
                return indexer_problem(
                    f"{h.arch}: layer range {a}:{b} holds only recurrent blocks; the graph's indexer k-pool input "
                    f"is then never allocated and llama.cpp aborts setting it (llm_graph_input_kpool::set_input, "
                    f"GGML_ASSERT(buffer)) without patch 0017-indexer-free-ranges (patches/llama.cpp in "
                    f"ggufswarm; `make setup` builds it), so a range needs an attention block",
                    hybrid_check(h, a, b) if h.recurrent is not None else None,
                )
            if not types[first]:
                full = [i for i in range(h.n_layers) if types[i] and not recurrent[i]]
                source = f"src/models/{h.arch.replace('_', '-')}.cpp"
                return (
                    f"{h.arch}: block {first} is a shared-indexer block (it reuses the top-k of an earlier "
                    f"full-indexer block, which llama.cpp cannot take across a cut: {source} asserts it); a layer "
                    f"range's first attention block must be a full-indexer block ({', '.join(map(str, full))})"
                )
        return hybrid_check(h, a, b) if h.recurrent is not None else None

    return check
