"""What each llama.cpp architecture needs to run as a layer range: ``ArchRules`` per architecture (``ARCH_RULES``),
the range checks some of them make, and the architectures that run only as the whole model (``WHOLE_ONLY``, with
the llama.cpp change that would lift each). ``derive.py`` writes shard GGUFs by these rules; what the rules do and
where in llama.cpp each comes from: docs/design.md, "A llama.cpp shard file".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...artifact.accounting import DEFAULT_SWA_PERIOD
from ...artifact.gguf_file import GGUFModelFile
from .errors import UnsupportedShard
from .range_checks import (
    _all_recurrent,
    _command_r_check,
    _deepseek2_check,
    _deepseek4_check,
    _deepstack_check,
    _dots3note_check,
    _ernie45_moe_check,
    _first_block_heads,
    _gemma3_check,
    _gemma4_check,
    _gemma4_unused,
    _glm_dsa_check,
    _hc_streams,
    _hybrid_check,
    _kimi_k3_check,
    _kv0_recurrent,
    _llama4_check,
    _minicpm_check,
    _minimax_m3_check,
    _nanbeige_check,
    _nemotron_h_recurrent,
    _no_rope_every_4,
    _smallthinker_check,
    _sqrt_n_embd,
    _whole_layers_check,
    n_model_layers,
)


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


_HYPER_CONNECTIONS = (
    "hyper-connections: hyper_connection.count residual streams cross a cut, and the graph takes "
    "batch.embd as a token embedding to expand (src/models/{}.cpp); needs a llama.cpp change taking "
    "the streams through batch.embd, as patch 0002 does for deepseek4"
)
WHOLE_ONLY: dict[str, str] = {
    "bloom": (
        "normalizes batch.embd with token_embd_norm as it does token embeddings (src/models/bloom.cpp), so a "
        "shard would normalize hidden states; needs a llama.cpp change skipping the input norm when "
        "embedding_length_in (patch 0001) is set"
    ),
    "minicpm3": (
        "scales batch.embd by a fixed 12 as it scales token embeddings, and its residual scale is "
        "1.4 / sqrt(n_layer) of the file's block count (src/models/minicpm3.cpp); needs a llama.cpp change "
        "scaling token input only and reading residual_scale, as minicpm.cpp does"
    ),
    "talkie": (
        "every block adds a learned multiple of the normalized input embedding (embd_skip, "
        "src/models/talkie.cpp), so two vectors per token cross a cut; needs a llama.cpp change taking the skip "
        "embedding as a second input"
    ),
    "hrm_text": (
        "its blocks are cache slots of low/high stacks run in nested cycles (src/models/hrm-text.cpp asserts "
        "block_count == layers_per_stack * h_cycles * (l_cycles + 1)); no block range is a part of the "
        "computation"
    ),
    "muse-glimmer": (
        "normalizes batch.embd (embd_norm: an RMS norm of the input, src/models/muse-glimmer.cpp) as it "
        "does token embeddings, so a shard would normalize hidden states again; needs a llama.cpp change "
        "normalizing token input only"
    ),
    "minimax-01": (
        "its lightning-attention decay is scaled by 1 - il / (n_layer - 1) of the file's own block index "
        "and count (src/models/minimax-01.cpp); needs a llama.cpp change reading the slope scale per layer"
    ),
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
    "afmoe": ArchRules(
        swa_pattern=4,
        leading_dense=True,
        token_scale=_sqrt_n_embd,
        patch="0003-hidden-state-input",
        check=_no_rope_every_4(
            "src/models/afmoe.cpp: use_rope = (il + 1) % n_no_rope_layer_step "
            "!= 0, a step of 4 (src/llama-hparams.h default)"
        ),
    ),
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
    "deepseek4": ArchRules(
        nextn=True,
        exact_states=True,
        patch="0002-deepseek4-layer-range",
        streams=_hc_streams,
        token_ids=True,
        tap="l_last",
        no_dummy_head=True,
        check=_deepseek4_check,
    ),
    # grown from llama.cpp's architecture zoo (tests/zoo.py, docs/architectures.md): each bitwise equal to llama.cpp's
    # whole model as shard chains; the rules from src/models/<arch>.cpp (load_arch_hparams, the graph)
    **{
        arch: ArchRules()
        for arch in (
            "arcee",
            "arctic",
            "baichuan",
            "chatglm",
            "codeshell",
            "dbrx",
            "deci",
            "ernie4_5",
            "exaone",
            "falcon",
            "gptneox",
            "grovemoe",
            "hunyuan-dense",
            "hunyuan-moe",
            "hunyuan_vl",
            "hy_v3",
            "internlm2",
            "jais",
            "jais2",
            "maincoder",
            "minimax-m2",
            "mistral3",
            "nemotron",
            "olmo",
            "olmoe",
            "openelm",
            "orion",
            "paddleocr",
            "pangu-embedded",
            "phi2",
            "phi3",
            "phimoe",
            "plamo",
            "qwen",
            "qwen2vl",
            "refact",
            "seed_oss",
            "stablelm",
            "starcoder2",
            "xverse",
            "grok",
            "granitemoe",
        )
    },
    # learned absolute positions added to the input (zeros past block 0: the hidden states hold them)
    **{arch: ArchRules(embd_add=("position_embd.weight",)) for arch in ("gpt2", "starcoder", "mpt")},
    # leading_dense_block_count read by the loader (src/models/<arch>.cpp)
    **{
        arch: ArchRules(leading_dense=True) for arch in ("bailingmoe", "bailingmoe2", "deepseek32", "dots1", "mistral4")
    },
    "minimax-m3": ArchRules(leading_dense=True, check=_minimax_m3_check),
    "ernie4_5-moe": ArchRules(leading_dense=True, check=_ernie45_moe_check),
    # GLM-4 aborts on embedding input of a text-only (non-M-RoPE) file unless patch 0003 (src/models/glm4.cpp), as
    # glm4moe
    "glm4": ArchRules(patch="0003-hidden-state-input"),
    "command-r": ArchRules(check=_command_r_check),
    "exaone4": ArchRules(
        check=_whole_layers_check(
            "exaone4", 64, "makes the 64-block model (32B) sliding-window (src/models/exaone4.cpp: if (n_layer == 64))"
        )
    ),
    "nanbeige": ArchRules(check=_nanbeige_check),
    "smollm3": ArchRules(
        check=_no_rope_every_4("src/models/smollm3.cpp: n_no_rope_layer_step = 4, use_rope = (il + 1) % 4 != 0")
    ),
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
    **{
        arch: ArchRules(recurrent=_kv0_recurrent, check=_first_block_heads, leading_dense=True)
        for arch in ("kimi-linear", "bailingmoe3")
    },
    "kimi-k3": ArchRules(recurrent=_kv0_recurrent, check=_kimi_k3_check, leading_dense=True),
    # (src/models/nemotron-h.cpp names a block's output nemotron_h_block_out)
    **{
        arch: ArchRules(recurrent=_nemotron_h_recurrent, check=_hybrid_check, tap="nemotron_h_block_out")
        for arch in ("nemotron_h", "nemotron_h_moe")
    },
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
            f"{', '.join(sorted(ARCH_RULES))}){hint}"
        ) from None


def swa_layers(model: GGUFModelFile, rules: ArchRules) -> list[bool] | None:
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
        raise UnsupportedShard(
            f"{arch}: llama.cpp needs {key} as a per-layer array, and this file has "
            f"{'none' if value is None else 'a scalar'}"
        )
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
