"""Derived shard GGUFs: blocks ``[a, b)`` of a model renumbered from 0, metadata fixed so llama.cpp runs them as it
would inside the whole model (the rules per architecture: archs.py, from llama.cpp's ``src/models/<arch>.cpp``
``load_arch_hparams`` and ``src/llama-hparams.cpp`` ``set_swa_pattern``, llama-cpp-python 0.3.36). What the rules
do, and why a shard without the head carries a one-token vocabulary: docs/design.md, "A llama.cpp shard file"."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from ...artifact.cut_rules import HEADS_PATCH, INDEXER_PATCH, ONE_KIND_PATCH, PATTERN_PATCH, Header, range_problem
from ...artifact.gguf_file import GGUFModelFile, dequantize_q8_0
from ..kv import TokenOutOfRange
from . import patches
from .archs import ARCH_RULES, rules_for
from .errors import UnsupportedShard
from .range_checks import n_model_layers


def node_range_problem(metadata: dict[str, Any], start: int, end: int, head: bool) -> str | None:
    """Why the loaded llama.cpp refuses blocks ``[start, end)`` of the model with GGUF ``metadata`` (None: it runs
    them): the cut rules ``plan`` places by (``artifact.cut_rules.range_problem``), with the patches this libllama
    carries (a range of one kind of block: ``ONE_KIND_PATCH``; a range starting at a block without heads:
    ``HEADS_PATCH``; a DSA range without an indexer block: ``INDEXER_PATCH``; a block pattern counted from a file's
    block 0: ``PATTERN_PATCH``), and the patch the architecture's
    ranges need (``ArchRules.patch``). The node's start-up check (``shard_metadata``) and ``--layers auto``
    (``swarm.shard_fetch``) ask this."""
    cuts = Header(metadata)
    problem = range_problem(
        cuts,
        start,
        end,
        head,
        one_kind=patches.applied(ONE_KIND_PATCH),
        head_sizes=patches.applied(HEADS_PATCH),
        indexer_inputs=patches.applied(INDEXER_PATCH),
        block_patterns=patches.applied(PATTERN_PATCH),
    )
    if problem or cuts.rules is None:
        return problem
    rules = rules_for(cuts.arch)
    if rules.patch and not (start == 0 and end == cuts.n_layers and head):
        return patches.patch_problem(rules.patch, f"a layer range of {cuts.arch}")
    return None


def shard_metadata(
    model: GGUFModelFile, start: int, end: int, head: bool
) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """Metadata of the shard GGUF for blocks ``[start, end)``: key → (value, type, array item type).

    Raises UnsupportedShard for an architecture outside ``ARCH_RULES``, a range the cut rules refuse
    (``artifact.cut_rules.range_problem``: the node's start-up check, the same ``plan`` places by), or one that needs a
    llama.cpp patch the loaded libllama lacks.
    """
    arch = model.architecture
    rules = rules_for(arch)
    n_blocks = int(model.metadata[f"{arch}.block_count"])
    cuts = Header(model.metadata)
    problem = node_range_problem(model.metadata, start, end, head)
    if problem:
        raise UnsupportedShard(problem)
    whole = start == 0 and end == cuts.n_layers and head
    extra = rules.check(model, start, end) if rules.check else {}
    out: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
    for key, value in model.metadata.items():
        vtype, item = model.metadata_types[key]
        if key.startswith("split."):
            continue
        if key.startswith("tokenizer."):  # llama.cpp's vocabulary costs 150 bytes a token; the head's grammar loads it
            continue
        if (
            key.startswith(f"{arch}.")
            and isinstance(value, list)
            and len(value) == n_blocks
            and not key.endswith(".rope.dimension_sections")
        ):  # (4 M-RoPE sections, whatever the block count)
            value = value[start:end]  # per-layer array
        out[key] = (value, vtype, item)
    out[f"{arch}.block_count"] = (end - start, GGUFValueType.UINT32, None)
    if rules.patch and not whole and not (rules.input_in_graph and start == 0):
        # the patched llama.cpp: this shard takes hidden states of this width (a first shard of an architecture that
        # transforms its input in the graph takes embeddings, transformed there as token input is)
        out[f"{arch}.embedding_length_in"] = (hidden_width(model, start), GGUFValueType.UINT32, None)
    if rules.place and not whole:  # (patch 0013) where the range's blocks sit in the whole model
        out[f"{arch}.block_offset"] = (start, GGUFValueType.UINT32, None)
        out[f"{arch}.block_count_whole"] = (n_model_layers(model), GGUFValueType.UINT32, None)
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
    swa = cuts.swa
    if swa is not None and any(swa) and not any(swa[start:end]) and cuts.rules.swa_optional:
        # an architecture whose SWA is optional: llama.cpp then builds a plain model (a plain KV cache), the range's
        # full-attention blocks compute as in the whole model (the others keep the window: patch ONE_KIND_PATCH gives
        # them an empty sliding-window cache)
        out[f"{arch}.attention.sliding_window"] = (0, GGUFValueType.UINT32, None)
    if swa is not None:
        out[f"{arch}.attention.sliding_window_pattern"] = (swa[start:end], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    recr = cuts.recurrent
    if recr is not None:
        out[f"{arch}.attention.recurrent_layers"] = (recr[start:end], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    for key, (value, vtype) in extra.items():
        out[key] = (value, vtype, GGUFValueType.UINT32 if vtype == GGUFValueType.ARRAY else None)
    out["tokenizer.ggml.model"] = ("none", GGUFValueType.STRING, None)
    # the head's logits and a graph that reads token ids (hash routing) need the vocabulary's size
    out[f"{arch}.vocab_size"] = (
        n_vocab(model) if head or rules.token_ids or rules.skip_embedding else 1,
        GGUFValueType.UINT32,
        None,
    )
    return out


def n_vocab(model: GGUFModelFile) -> int:
    """Vocabulary size of the whole model (rows of ``token_embd``, else ``vocab_size`` or the token list)."""
    if "token_embd.weight" in model.tensors:
        return int(model.tensors["token_embd.weight"].shape[0])
    md = model.metadata
    return int(md.get(f"{model.architecture}.vocab_size") or len(md.get("tokenizer.ggml.tokens", [])))


def hidden_width(model: GGUFModelFile, cut: int) -> int:
    """Values per token of the hidden state crossing a cut before block ``cut`` (0: the first shard's input):
    ``n_embd``, or ``streams x n_embd`` where the architecture widens its residual stream (``ArchRules.streams``:
    DeepSeek-V4's ``hyper_connection.count`` = 4 streams at every cut; kimi-k3's attention residuals, one more
    ``n_embd`` per checkpoint banked before the cut)."""
    rules = rules_for(model.architecture)
    n_embd = int(model.metadata[f"{model.architecture}.embedding_length"])
    return n_embd * (rules.streams(model.metadata, cut) if rules.streams else 1)


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
    no_output = leaves_out_output(model, head)
    out = []
    for name, info in model.tensors.items():
        layer = info.layer
        if layer is not None:
            if not start <= layer < end or layer >= n_layer:
                continue
            new_name = f"blk.{layer - start}.{name.split('.', 2)[2]}"
        elif name in rules.embd_add and start > 0:
            continue  # a zero stand-in (_stand_ins): the hidden states coming in already hold it
        elif name in ("token_embd.weight", "output.weight") and rules.skip_embedding:
            # every block adds the token's normalized embedding (talkie); a llama.cpp without the architecture's
            # optional-output patch requires its vocabulary-sized LM head too, and a non-head shard's graph then
            # computes logits with it that nobody reads (with the patch: no head, no logits)
            if name == "output.weight" and no_output:
                continue
            new_name = name
        elif name in ("token_embd.weight", "output.weight", "output.bias", "output_norm.weight"):
            if not head or (
                rules.no_dummy_head and name == "token_embd.weight" and not (start == 0 and end == n_layer)
            ):
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
    out = [
        (name, np.zeros(model.tensors[name].shape, np.float16))
        for name in rules.embd_add
        if start > 0 and name in model.tensors
    ]
    if head or rules.no_dummy_head:
        return out
    n_embd = int(model.metadata[f"{arch}.embedding_length"])
    stand = {
        "token_embd.weight": np.zeros((1, n_embd), np.float32),
        "output.weight": np.zeros((1, n_embd), np.float32),
        "output.bias": np.zeros(1, np.float32),
        "output_norm.weight": np.ones(n_embd, np.float32),
    }
    if rules.skip_embedding:  # (the shard carries the model's token embedding, and LM head or none: shard_tensors)
        del stand["token_embd.weight"], stand["output.weight"]
    return [
        (name, array) for name, array in stand.items() if name == "token_embd.weight" or name in model.tensors
    ] + out


def _write_gguf(
    model: GGUFModelFile,
    dest: Path,
    metadata: dict,
    tensors: list[tuple[str, str]],
    arrays: list[tuple[str, np.ndarray]],
) -> Path:
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
    return _write_gguf(
        model, Path(dest), metadata, shard_tensors(model, start, end, head), _stand_ins(model, head, start)
    )


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
    metadata.update(
        {
            "split.no": (0, GGUFValueType.UINT16, None),
            "split.count": (1 + len(model.paths), GGUFValueType.UINT16, None),
            "split.tensors.count": (len(tensors) + len(stand_ins), GGUFValueType.INT32, None),
            "split.sources.tensors": ([name for name, _ in tensors], GGUFValueType.ARRAY, GGUFValueType.STRING),
            "split.sources.block_offset": (start, GGUFValueType.UINT32, None),
        }
    )
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


def leaves_out_output(model: GGUFModelFile, head: bool) -> bool:
    """Whether a shard of ``model`` without the head stage (``head`` False) leaves out the LM head its architecture's
    loader would otherwise require: the loaded libllama carries the patch making it optional
    (``ArchRules.optional_output``)."""
    rules = ARCH_RULES.get(model.architecture)
    optional = None if head or rules is None else rules.optional_output
    return optional is not None and patches.applied(optional)


def shard_file_name(model: GGUFModelFile, start: int, end: int, head: bool) -> str:
    """A name that identifies the derived file: model fingerprint, range, head stage, ``-no-output`` when it leaves
    out the LM head (``leaves_out_output``: a file made with the patch is never taken by a llama.cpp without it, nor
    the other way round), format version."""
    stage = "-head" if head else "-no-output" if leaves_out_output(model, head) else ""
    return f"{model.fingerprint[:16]}-{start}-{end}{stage}-v3.gguf"


def shard_paths(
    model: GGUFModelFile, start: int, end: int, head: bool, cache_dir: str | os.PathLike, in_place: bool | None = None
) -> list[Path]:
    """The files llama.cpp loads for the shard ``[start, end)``, derived under ``cache_dir`` on first use.

    The whole model with its head (``start == 0``, ``end == n_layers``, no MTP blocks, one file) is the original file
    itself. Otherwise, ``in_place`` (default: when the loaded libllama carries patch 0004): the shard's header
    (``derive_shard_header``) followed by the model's own files, which llama.cpp reads the shard's tensors from in
    place; else one derived shard GGUF holding a copy of them (``derive_shard``). Raises UnsupportedShard for a range
    the loaded libllama refuses (``node_range_problem``), also where a file derived for it is cached (by a libllama
    with a patch this one lacks: it would compute something else).
    """
    if (
        start == 0
        and end == n_model_layers(model)
        and head
        and n_model_layers(model) == int(model.metadata[f"{model.architecture}.block_count"])
        and len(model.paths) == 1
    ):
        rules_for(model.architecture)
        return [model.path]
    problem = node_range_problem(model.metadata, start, end, head)
    if problem:
        raise UnsupportedShard(problem)
    if in_place is None:
        in_place = patches.applied("0004-split-sources")
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


@dataclass(frozen=True)
class ShardModelInfo:
    """What the node and clients need to know of the model a llama.cpp shard belongs to."""

    arch: str
    n_layers: int  # blocks a route covers (MTP/nextn blocks excluded)
    n_embd: int  # values per token of a hidden state into the first block (derive.hidden_width at cut 0)
    n_vocab: int
    context_length: int  # trained context (tokens)
    widths: tuple[int, ...] = ()  # hidden_width at each cut 0..n_layers where it differs between cuts (kimi-k3)

    def width_at(self, cut: int) -> int:
        """Values per token of the hidden states crossing a cut before block ``cut`` (a shard ``[a, b)`` takes
        ``width_at(a)`` and sends ``width_at(b)``): ``n_embd`` but for an architecture whose state at a cut grows
        (``widths``)."""
        return self.widths[cut] if self.widths else self.n_embd

    @property
    def max_length(self) -> int:
        """Longest session this model allows: min(trained context, 128K cap)."""
        return min(self.context_length, 131072)


def model_info(model: GGUFModelFile) -> ShardModelInfo:
    """ShardModelInfo from a GGUF header; UnsupportedShard for an architecture outside the table."""
    arch = model.architecture
    rules_for(arch)
    md = model.metadata
    n_layers = n_model_layers(model)
    widths = tuple(hidden_width(model, cut) for cut in range(n_layers + 1))
    return ShardModelInfo(
        arch,
        n_layers,
        widths[0],
        n_vocab(model),
        int(md.get(f"{arch}.context_length", 4096)),
        widths if len(set(widths)) > 1 else (),
    )


__all__ = [
    "ShardModelInfo",
    "TokenEmbedding",
    "derive_shard",
    "derive_shard_header",
    "hidden_width",
    "model_info",
    "n_vocab",
    "shard_metadata",
    "shard_paths",
    "shard_tensors",
]
