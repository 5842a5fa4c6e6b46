"""What each llama.cpp architecture needs to run as a layer range: ``ArchRules`` per architecture (``ARCH_RULES``):
what a shard file of it is written with (``derive.py``), beside the cut rules (which ranges a node refuses, and the
sliding-window and recurrent layouts), which live in ``artifact/cut_rules.py`` for ``plan`` and the node alike. What
the rules do and where in llama.cpp each comes from: docs/design.md, "A llama.cpp shard file".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...artifact.cut_rules import CUT_RULES, RANGE_PATCH, WHOLE_ONLY, Header, residual_streams, unsupported
from ...artifact.gguf_file import GGUFModelFile
from .errors import UnsupportedShard
from .range_checks import (
    _deepseek2_check,
    _deepseek4_check,
    _deepstack_check,
    _ernie45_moe_check,
    _gemma4_unused,
    _glm_dsa_check,
    _headless_unused,
    _minicpm_check,
    _qwen4exp_check,
    _qwen4exp_unused,
    _recurrent_heads_check,
    _sqrt_n_embd,
)


@dataclass(frozen=True)
class ArchRules:
    """How llama.cpp is given a layer range of one architecture (which ranges it refuses, and its sliding-window and
    recurrent layouts: ``artifact.cut_rules.CUT_RULES``).

    ``leading_dense``: the model has ``leading_dense_block_count``; ``nextn``: it may carry MTP blocks;
    ``exact_states``: llama.cpp's cache for it cannot truncate a sequence partway whatever the range (the
    shard then truncates only to exact state checkpoints, as recurrent ones do);
    ``token_scale``: factor llama.cpp applies to token embeddings only (not to ``batch.embd``), as a
    function of ``n_embd``; ``check``: ``(model, a, b)`` → extra metadata to write for the range (called once the
    cut rules accepted it).

    ``patch``: the patch of ggufswarm's llama.cpp patch queue (``patches/llama.cpp``) a layer range of this
    architecture needs (``llamacpp.patches``); its shards declare their input width as ``{arch}.embedding_length_in``,
    which that patched llama.cpp reads (the hidden states of the previous block, not media embeddings).
    ``streams``: ``(metadata, cut)`` → the residual state at a cut before block ``cut`` is this many ``n_embd``
    vectors per token (DeepSeek-V4's hyper-connections: ``hyper_connection.count`` at every cut; kimi-k3's
    attention residuals: the stream and the checkpoints banked before the cut, more the later the cut); frames
    carry ``streams * n_embd`` values per token;
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

    With patch ``RANGE_PATCH`` (0013): ``input_in_graph``: the graph transforms its input before block 0 (bloom's
    token_embd_norm, muse-glimmer's and talkie's RMS norm, minicpm3's scale of 12), on token input or in a file
    without ``embedding_length_in``: the first shard's file declares none, so llama.cpp applies it to the embeddings
    the shard passes, and every later shard's declares it (its hidden states were transformed);
    ``skip_embedding``: every block adds the token's normalized input embedding (talkie's ``embd_skip``): every shard
    carries the token embedding, and a shard past the first reads the token ids with its hidden states;
    ``place``: the graph computes with a block's index or the block count (minimax-01's decay scale, smallthinker's
    no-RoPE step, minicpm3's residual scale; with patch 0020 afmoe's, smollm3's and llama4's no-RoPE and MoE blocks;
    with 0019 kimi-k3's checkpoint blocks): a range's file declares ``block_offset`` (the whole model's index of its
    block 0) and ``block_count_whole``.
    ``optional_output``: the llama.cpp patch that makes the architecture's LM head optional (talkie: 0018, whose
    every shard carries the real vocabulary for ``skip_embedding``): with it, a shard without the head stage leaves
    ``output.weight`` out and its graph computes no logits; without it the shard carries the model's LM head.
    """

    leading_dense: bool = False
    nextn: bool = False
    exact_states: bool = False
    token_scale: Callable[[int], np.float32] | None = None
    check: Callable[[GGUFModelFile, int, int], dict[str, Any]] | None = None
    patch: str | None = None
    streams: Callable[[dict, int], int] | None = None
    token_ids: bool = False
    tap: str = "l_out"
    no_dummy_head: bool = False
    embd_add: tuple[str, ...] = ()  # global tensors the graph adds to its input (zeros on a shard past block 0)
    unused: Callable[[GGUFModelFile, int, int], frozenset[str]] | None = None  # global tensors a range leaves out
    input_in_graph: bool = False
    skip_embedding: bool = False
    place: bool = False
    optional_output: str | None = None


_LEADING_DENSE = ArchRules(leading_dense=True)
# hyper-connection streams across a cut with the token ids beside them, the graph ending at the last block's l_last
# when the range has no head (deepseek4, qwen4exp)
_STREAMS_AND_TOKEN_IDS: dict[str, Any] = dict(
    nextn=True, streams=residual_streams, token_ids=True, tap="l_last", no_dummy_head=True
)
_DEEPSTACK = ArchRules(check=_deepstack_check)
# the architectures that need more than the defaults to be written as a shard (every other one of CUT_RULES: none)
_RULES: dict[str, ArchRules] = {
    "gemma3": ArchRules(token_scale=_sqrt_n_embd),
    # Gemma 1/2 and AFMoE scale token input by sqrt(n_embd) in the graph, and did the same to batch.embd until
    # patch 0003 (src/models/gemma.cpp, gemma2.cpp, afmoe.cpp)
    "gemma": ArchRules(token_scale=_sqrt_n_embd, patch="0003-hidden-state-input"),
    "gemma2": ArchRules(token_scale=_sqrt_n_embd, patch="0003-hidden-state-input"),
    "afmoe": ArchRules(leading_dense=True, token_scale=_sqrt_n_embd, patch="0003-hidden-state-input", place=True),
    # the no-RoPE block of every 4 (and llama4's MoE block of every interleave_moe_layer_step, its last block without
    # RoPE) counted in the whole model with patch 0020 (block_offset, block_count_whole)
    **{arch: ArchRules(place=True) for arch in ("smollm3", "llama4")},
    # CogVLM: batch.embd ran through the vision-expert weights (image tokens) until patch 0003
    "cogvlm": ArchRules(patch="0003-hidden-state-input"),
    # Gemma 4 31B / 26B-A4B (src/models/gemma4.cpp): sqrt(n_embd) on token input, rope_freqs on full-attention blocks
    # only; E2B/E4B (per-layer embeddings, shared KV) run as the whole model
    "gemma4": ArchRules(token_scale=_sqrt_n_embd, unused=_gemma4_unused),
    "deepseek": _LEADING_DENSE,
    "deepseek2": ArchRules(leading_dense=True, nextn=True, check=_deepseek2_check),
    "glm4moe": ArchRules(leading_dense=True, nextn=True, patch="0003-hidden-state-input"),
    # IMRoPE: a hidden-state batch carries 4 positions per token (backend.LlamaCppShard.n_pos_per_token)
    **{arch: ArchRules(nextn=True) for arch in ("qwen3next", "qwen35moe", "qwen35")},
    "glm-dsa": ArchRules(leading_dense=True, nextn=True, check=_glm_dsa_check),
    # hc_mult residual streams cross a cut (frames of hc*n_embd per token), the hash-routed blocks read token ids,
    # the last block's output is named l_last (src/models/deepseek4.cpp)
    "deepseek4": ArchRules(
        exact_states=True, patch="0002-deepseek4-layer-range", check=_deepseek4_check, **_STREAMS_AND_TOKEN_IDS
    ),
    # hc residual streams cross a cut (patch 0015: frames of hc*n_embd per token); the output head's stand-ins are
    # written as for any range (the graph ends at the tap on the last block's l_out)
    **{
        arch: ArchRules(leading_dense=True, nextn=nextn, patch="0015-hyper-connection-ranges", streams=residual_streams)
        for arch, nextn in (("hy_v4", False), ("glm5-next", True))
    },
    # qwen4exp also hashes the token ids of the step and of earlier positions (its n-gram embeddings): every shard's
    # batch carries them; a range without the head ends at l_last, the last block's streams (patch 0015)
    "qwen4exp": ArchRules(
        patch="0015-hyper-connection-ranges", check=_qwen4exp_check, unused=_qwen4exp_unused, **_STREAMS_AND_TOKEN_IDS
    ),
    # learned absolute positions added to the input (zeros past block 0: the hidden states hold them)
    **{arch: ArchRules(embd_add=("position_embd.weight",)) for arch in ("gpt2", "starcoder", "mpt")},
    # leading_dense_block_count read by the loader (src/models/<arch>.cpp)
    **{
        arch: _LEADING_DENSE
        for arch in (
            "bailingmoe",
            "bailingmoe2",
            "deepseek32",
            "dots1",
            "mistral4",
            "minimax-m3",
            "cohere2moe",
            "exaone-moe",
            "dots3note",
            "laguna",
            "lfm2moe",
        )
    },
    # a range starting at a KDA block gives it the whole model's block-0 head count, which KDA blocks compute with
    **{arch: ArchRules(leading_dense=True, check=_recurrent_heads_check) for arch in ("kimi-linear", "bailingmoe3")},
    # the bank of attention-residual checkpoints crosses a cut with the residual stream (patch 0019: frames of
    # (checkpoints + 1) * n_embd per token, wider at each later checkpoint block); a range banks on the whole model's
    # checkpoint blocks (block_offset) and its output is l_bank, the bank and the stream of its last block
    "kimi-k3": ArchRules(
        leading_dense=True,
        patch="0019-attention-residual-ranges",
        streams=residual_streams,
        tap="l_bank",
        place=True,
        check=_recurrent_heads_check,
    ),
    "ernie4_5-moe": ArchRules(leading_dense=True, check=_ernie45_moe_check),
    # GLM-4 aborts on embedding input of a text-only (non-M-RoPE) file unless patch 0003 (src/models/glm4.cpp), as
    # glm4moe
    "glm4": ArchRules(patch="0003-hidden-state-input"),
    "minicpm": ArchRules(check=_minicpm_check),
    **{arch: _DEEPSTACK for arch in ("granite", "qwen3vl", "qwen3vlmoe", "granite_swa")},
    "plamo2": ArchRules(tap="ffn_residual"),  # src/models/plamo2.cpp
    # a range of Mamba blocks only leaves out rope_freqs (patch 0014 lets a range start at a block without heads)
    "granitehybrid": ArchRules(unused=_headless_unused),
    # patch 0013: the input transform on token input only (bloom, muse-glimmer, minicpm3, talkie), talkie's skip
    # embedding from the token ids, a block's place in the whole model (minimax-01, smallthinker, minicpm3)
    **{arch: ArchRules(patch=RANGE_PATCH, input_in_graph=True) for arch in ("bloom", "muse-glimmer")},
    "minicpm3": ArchRules(patch=RANGE_PATCH, input_in_graph=True, place=True),
    "talkie": ArchRules(
        patch=RANGE_PATCH, input_in_graph=True, skip_embedding=True, optional_output="0018-talkie-output-optional"
    ),
    **{arch: ArchRules(patch=RANGE_PATCH, place=True) for arch in ("minimax-01", "smallthinker")},
    # (src/models/nemotron-h.cpp names a block's output nemotron_h_block_out)
    **{arch: ArchRules(tap="nemotron_h_block_out") for arch in ("nemotron_h", "nemotron_h_moe")},
}
# every architecture a llama.cpp node runs (the cut rules' table): its rules, the defaults for most
ARCH_RULES: dict[str, ArchRules] = {arch: _RULES.get(arch, ArchRules()) for arch in CUT_RULES}


def rules_for(arch: str) -> ArchRules:
    """The ArchRules of ``arch``; UnsupportedShard naming the supported ones otherwise."""
    try:
        return ARCH_RULES[arch]
    except KeyError:
        from ...model import SUPPORTED as TORCH_ARCHS

        hint = "; --backend torch runs it" if arch in TORCH_ARCHS else ""
        raise UnsupportedShard(unsupported(arch) + hint) from None


def recurrent_layers(model: GGUFModelFile) -> list[bool] | None:
    """Per-block recurrent flags of the whole model as llama.cpp computes them (None: no recurrent blocks;
    ``artifact.cut_rules.Header.recurrent``)."""
    return Header(model.metadata).recurrent


__all__ = ["ARCH_RULES", "ArchRules", "WHOLE_ONLY", "recurrent_layers", "rules_for"]
