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
* heuristics llama.cpp applies to the layer count are resolved from the whole model and written
  out, or the range is refused when llama.cpp cannot be told (Gemma 3 27B's attention scale).

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
    ``swa_dense_first``: the pattern's first layer is the full-attention one;
    ``leading_dense``: the model has ``leading_dense_block_count``; ``nextn``: it may carry MTP blocks;
    ``recurrent_interval``: hybrid recurrent model whose recurrent blocks llama.cpp derives from
    ``full_attention_interval`` (this is its default) when ``attention.recurrent_layers`` is absent (0: none);
    ``exact_states``: llama.cpp's cache for it cannot truncate a sequence partway whatever the range (the
    shard then truncates only to exact state checkpoints, as recurrent ones do);
    ``token_scale``: factor llama.cpp applies to token embeddings only (not to ``batch.embd``), as a
    function of ``n_embd``; ``check``: raises UnsupportedShard for ranges llama.cpp would misread,
    and may return extra metadata to write; ``embd_input``: set when the architecture's graph aborts
    on hidden-state input, which leaves only the whole model runnable.

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
    """

    swa_pattern: int = 0
    swa_dense_first: bool = False
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
    if all(flags) or not any(flags):
        kind = "full-attention" if all(flags) else "recurrent"
        raise UnsupportedShard(f"{model.architecture}: layer range {a}:{b} has no {kind} block; llama.cpp's hybrid "
                               f"memory aborts on a graph without both kinds (llm_graph_input_mem_hybrid::set_input), "
                               f"so a shard must hold at least one recurrent and one full-attention block")
    return {}


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
    return np.sqrt(np.float32(n_embd))  # sqrtf(n_embd), src/models/gemma3.cpp


ARCH_RULES: dict[str, ArchRules] = {
    "llama": ArchRules(),
    "qwen2": ArchRules(),
    "qwen3": ArchRules(),
    "qwen2moe": ArchRules(),
    "qwen3moe": ArchRules(),
    "gemma3": ArchRules(swa_pattern=DEFAULT_SWA_PERIOD["gemma3"], token_scale=_sqrt_n_embd, check=_gemma3_check),
    "deepseek": ArchRules(leading_dense=True),
    "deepseek2": ArchRules(leading_dense=True, nextn=True, check=_deepseek2_check),
    "glm4moe": ArchRules(leading_dense=True, nextn=True, patch="0003-glm4-layer-range-input"),
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
    if not rules.swa_pattern or not md.get(f"{arch}.attention.sliding_window"):
        return None
    n = int(md[f"{arch}.block_count"])
    key = f"{arch}.attention.sliding_window_pattern"
    value = md.get(key)
    if isinstance(value, list):
        return [bool(v) for v in value]
    period = int(value) if value is not None else rules.swa_pattern
    if rules.swa_dense_first:
        return [period == 0 or il % period != 0 for il in range(n)]
    return [period == 0 or il % period < period - 1 for il in range(n)]


def recurrent_layers(model: GGUFModelFile) -> list[bool] | None:
    """Per-block recurrent flags of the whole model as llama.cpp computes them (None: not a hybrid recurrent
    architecture). ``attention.recurrent_layers`` when the file has it, else from ``full_attention_interval``
    (``src/models/qwen3next.cpp``: recurrent unless ``(i + 1) % interval == 0``; MTP blocks are not recurrent)."""
    arch = model.architecture
    rules = rules_for(arch)
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
    out: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
    for key, value in model.metadata.items():
        vtype, item = model.metadata_types[key]
        if key.startswith("split."):
            continue
        if not head and key.startswith("tokenizer."):
            continue
        if key.startswith(f"{arch}.") and isinstance(value, list) and len(value) == n_blocks:
            value = value[start:end]  # per-layer array
        out[key] = (value, vtype, item)
    out[f"{arch}.block_count"] = (end - start, GGUFValueType.UINT32, None)
    if rules.patch and not whole:  # the patched llama.cpp: this shard takes hidden states of this width
        out[f"{arch}.embedding_length_in"] = (hidden_width(model), GGUFValueType.UINT32, None)
    if rules.nextn:
        out[f"{arch}.nextn_predict_layers"] = (0, GGUFValueType.UINT32, None)
    if rules.leading_dense and f"{arch}.leading_dense_block_count" in model.metadata:
        lead = int(model.metadata[f"{arch}.leading_dense_block_count"])
        out[f"{arch}.leading_dense_block_count"] = (max(0, lead - start), GGUFValueType.UINT32, None)
    swa = _swa_layers(model, rules)
    if swa is not None and any(swa) and not any(swa[start:end]):
        raise UnsupportedShard(f"{arch}: layer range {start}:{end} holds no sliding-window layer, and llama.cpp's "
                               f"memory for a model with sliding-window attention asserts one (src/llama-model.cpp "
                               f"create_memory: is_swa_any); widen the range (sliding-window layers: "
                               f"{', '.join(str(i) for i, w in enumerate(swa) if w)})")
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
    every shard."""
    rules = rules_for(model.architecture)
    n_layer = n_model_layers(model)
    out = []
    for name, info in model.tensors.items():
        layer = info.layer
        if layer is not None:
            if not start <= layer < end or layer >= n_layer:
                continue
            new_name = f"blk.{layer - start}.{name.split('.', 2)[2]}"
        elif name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            if not head or (rules.no_dummy_head and name == "token_embd.weight" and not (start == 0 and end == n_layer)):
                continue  # (a patched graph taking hidden states needs no token embedding)
            new_name = name
        elif name.startswith("output_") and rules.no_dummy_head and not head:
            continue  # the rest of the output head (DeepSeek-V4's output_hc_*)
        else:
            new_name = name  # global tensors a block may use (e.g. rope_freqs)
        out.append((name, new_name))
    return out


def _stand_ins(model: GGUFModelFile, head: bool) -> list[tuple[str, np.ndarray]]:
    """One-row token embedding and LM head (and a unit output norm) a shard without the head stage carries in place
    of the model's (its vocabulary is one token; llama.cpp's loader requires the tensors)."""
    arch = model.architecture
    if head or rules_for(arch).no_dummy_head:
        return []
    n_embd = int(model.metadata[f"{arch}.embedding_length"])
    return [("token_embd.weight", np.zeros((1, n_embd), np.float32)),
            ("output.weight", np.zeros((1, n_embd), np.float32)),
            ("output_norm.weight", np.ones(n_embd, np.float32))]


def _write_gguf(model: GGUFModelFile, dest: Path, metadata: dict, tensors: list[tuple[str, str]],
                arrays: list[tuple[str, np.ndarray]]) -> Path:
    """Write a GGUF with ``metadata``, the raw bytes of ``tensors`` (``(model name, new name)``, read from ``model``)
    and ``arrays``, to a temporary name renamed to ``dest`` (a crash never leaves a half file behind)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), model.architecture)
    writer.kv_data[0].clear()  # GGUFWriter pre-adds general.architecture; we copy every key in order
    for key, (value, vtype, item) in metadata.items():
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
    return _write_gguf(model, Path(dest), metadata, shard_tensors(model, start, end, head), _stand_ins(model, head))


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
    stand_ins = _stand_ins(model, head)
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


def shard_path(model: GGUFModelFile, start: int, end: int, head: bool, cache_dir: str | os.PathLike) -> Path:
    """The one derived shard GGUF (a copy of the shard's tensors) for ``[start, end)`` under ``cache_dir``, written on
    first use; the original file for the whole model (``shard_paths`` with ``in_place=False``)."""
    return shard_paths(model, start, end, head, cache_dir, in_place=False)[0]


__all__ = ["ARCH_RULES", "ArchRules", "TokenEmbedding", "UnsupportedShard", "derive_shard", "derive_shard_header",
           "hidden_width", "shard_paths", "shard_tensors",
           "n_model_layers", "n_vocab",
           "rules_for", "shard_metadata", "shard_path"]
