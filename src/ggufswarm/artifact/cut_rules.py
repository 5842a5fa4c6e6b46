"""The cut rules: which layer ranges ``[a, b)`` of a model a llama.cpp node can serve, from the GGUF header alone.

One source for both sides: ``ggufswarm plan`` (``HeaderAccounts.range_problem``, and so ``planning.place``) and a
node's start-up check (``runtime/llamacpp/derive.shard_metadata``) call ``range_problem`` here, so whatever ``plan``
places, the node accepts. ``CUT_RULES``: per architecture, the sliding-window and recurrent layouts llama.cpp derives
and the architecture's own check (``cut_checks``); what the node writes into a shard file stays in
``runtime/llamacpp/archs.py``. docs/design.md, "A llama.cpp shard file"; docs/architectures.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from . import cut_checks as c
from .cut_checks import Check

# the llama.cpp patch (patches/llama.cpp) that builds the memory of a layer range for the kinds of block it holds: a
# sliding-window model's range without a sliding-window block (an empty sliding-window cache)
ONE_KIND_PATCH = "0011-one-kind-layer-ranges"
# the llama.cpp patch that computes a layer range as the same blocks inside the whole model where graphs read a
# block's place in the whole model or transform their input (runtime/llamacpp/archs.py)
RANGE_PATCH = "0013-layer-ranges-compute-as-whole"
# the llama.cpp patch that takes a hybrid's head sizes from its first block with heads (not block 0), and builds
# jamba's and lfm2's attention blocks with their own head count: a range may start at a block without heads
HEADS_PATCH = "0014-hybrid-ranges-start-at-any-block"

# the llama.cpp patch that sets a DSA graph's indexer inputs only where a layer uses them: a range of GLM-5-Next
# without an attention block, of dots.llm3-note without a lightning-indexer block
INDEXER_PATCH = "0017-indexer-free-ranges"
# the llama.cpp patch whose afmoe, smollm3, llama4 and ernie4_5-moe graphs count their no-RoPE and MoE blocks from the
# whole model's block 0 (block_offset, block_count_whole: patch 0013), so a range may start and end at any block
PATTERN_PATCH = "0020-block-patterns-of-the-whole-model"

# llama.cpp's sliding-window period for architectures that set it in code when the GGUF has no
# attention.sliding_window_pattern (src/llama-model.cpp load_hparams: set_swa_pattern)
DEFAULT_SWA_PERIOD = {"gemma3": 6, "gpt-oss": 2}


@dataclass(frozen=True)
class CutRules:
    """What of an architecture decides its layer ranges. ``swa_pattern``: llama.cpp's default sliding-window period
    when the GGUF has none (0: no SWA); ``swa_dense_first``: the pattern's first layer is the full-attention one;
    ``swa_array``: llama.cpp reads the sliding-window layers only from the per-layer ``sliding_window_pattern``
    array; ``swa_optional``: sliding-window only when ``attention.sliding_window`` > 0 and full-attention blocks
    compute alike either way (a range without sliding-window blocks runs as a plain model, not refused);
    ``recurrent_interval``: hybrid model whose recurrent blocks llama.cpp derives from ``full_attention_interval``
    (this is its default) when ``attention.recurrent_layers`` is absent; ``recurrent``: header → per-block recurrent
    flags, where llama.cpp derives them from other hyperparameters; ``check``: the architecture's own refusals
    (``cut_checks``); ``whole_only``: why only the whole model runs (the graph misreads hidden-state input), naming
    the llama.cpp change that would lift it."""

    swa_pattern: int = 0
    swa_dense_first: bool = False
    swa_array: bool = False
    swa_optional: bool = False
    recurrent_interval: int = 0
    recurrent: Any = None  # Callable[[Header], list[bool]] | None
    check: Check | None = None
    whole_only: str | None = None


WHOLE_ONLY: dict[str, str] = {
    "hrm_text": (
        "its blocks are cache slots of low/high stacks run in nested cycles (src/models/hrm-text.cpp asserts "
        "block_count == layers_per_stack * h_cycles * (l_cycles + 1)); no block range is a part of the "
        "computation"
    ),
}

_HYBRID = CutRules(recurrent=c.kv0_recurrent, check=c.hybrid_check)
_INTERVAL4 = CutRules(recurrent_interval=4, check=c.hybrid_check)
_SWA4 = CutRules(swa_pattern=4)
_SWA_ARRAY = CutRules(swa_array=True)
_NEMOTRON_H = ("nemotron_h", "nemotron_h_moe")
# every architecture a llama.cpp node runs (docs/architectures.md); those without rules of their own cut anywhere
CUT_RULES: dict[str, CutRules] = {
    **{
        arch: CutRules()
        for arch in (
            "llama qwen2 qwen3 qwen2moe qwen3moe gemma cogvlm deepseek deepseek4 glm4moe arcee arctic baichuan chatglm "
            "codeshell dbrx deci ernie4_5 exaone falcon gptneox grovemoe hunyuan-dense hunyuan-moe hunyuan_vl hy_v3 "
            "internlm2 jais jais2 maincoder minimax-m2 mistral3 nemotron olmo olmoe openelm orion paddleocr "
            "pangu-embedded phi2 phi3 phimoe plamo qwen qwen2vl refact seed_oss stablelm starcoder2 xverse grok "
            "granitemoe gpt2 starcoder mpt bailingmoe bailingmoe2 deepseek32 dots1 mistral4 glm4 minicpm granite "
            "qwen3vl qwen3vlmoe bloom minicpm3 talkie"
        ).split()
    },
    "gemma3": CutRules(swa_pattern=DEFAULT_SWA_PERIOD["gemma3"], check=c.gemma3_check),
    "gemma2": CutRules(swa_pattern=2),
    "afmoe": CutRules(
        swa_pattern=4,
        check=c.no_rope_every_4(
            "src/models/afmoe.cpp: use_rope = (il + 1) % n_no_rope_layer_step != 0, a step of 4 (src/llama-hparams.h "
            "default)"
        ),
    ),
    "gemma4": CutRules(swa_array=True, check=c.gemma4_check),
    "deepseek2": CutRules(check=c.deepseek2_check),
    "gpt-oss": CutRules(swa_pattern=DEFAULT_SWA_PERIOD["gpt-oss"]),
    **{arch: _INTERVAL4 for arch in ("qwen3next", "qwen35moe", "qwen35")},
    "glm-dsa": CutRules(check=c.glm_dsa_check),
    "minimax-m3": CutRules(check=c.minimax_m3_check),
    "ernie4_5-moe": CutRules(check=c.ernie45_moe_check),
    "command-r": CutRules(check=c.command_r_check),
    "exaone4": CutRules(
        check=c.whole_layers_check(
            "exaone4", 64, "makes the 64-block model (32B) sliding-window (src/models/exaone4.cpp: if (n_layer == 64))"
        )
    ),
    "nanbeige": CutRules(check=c.nanbeige_check),
    "smollm3": CutRules(
        check=c.no_rope_every_4("src/models/smollm3.cpp: n_no_rope_layer_step = 4, use_rope = (il + 1) % 4 != 0")
    ),
    # sliding-window models: the default period of load_swa_pattern (or the per-layer array llama.cpp requires)
    "cohere2": _SWA4,
    "cohere2moe": CutRules(swa_pattern=4, swa_dense_first=True),
    "exaone-moe": _SWA4,
    **{arch: _SWA_ARRAY for arch in ("granite_swa", "maple", "mimo2", "spark2_5")},
    "dots3note": CutRules(swa_array=True, check=c.dots3note_check),
    # (its no-RoPE block of every 4 counts in the whole model with patch 0013: runtime/llamacpp/archs.py RANGE_PATCH)
    "smallthinker": CutRules(swa_pattern=4, swa_dense_first=True),
    "muse-glimmer": _SWA4,
    # lightning-attention blocks but every 8th (src/models/minimax-01.cpp: full_attention_interval, default 8)
    "minimax-01": CutRules(recurrent_interval=8, check=c.hybrid_check),
    # hyper-connection streams cross a cut (patch 0015); DSA blocks may share an earlier block's indexer top-k
    "hy_v4": CutRules(check=c.shared_indexer_check(0)),
    "glm5-next": CutRules(recurrent=c.kv0_recurrent, check=c.shared_indexer_check(1)),
    # (and its per-block recurrent flags from attention.recurrent_layers)
    "qwen4exp": CutRules(recurrent_interval=4, check=c.hybrid_check),
    "llama4": CutRules(swa_pattern=4, check=c.llama4_check),
    **{arch: CutRules(swa_pattern=4, swa_optional=True) for arch in ("mellum", "olmo2")},
    "plamo3": CutRules(swa_pattern=8, swa_optional=True),
    "laguna": CutRules(swa_pattern=4, swa_dense_first=True, swa_optional=True),
    # recurrent: every block; hybrid: recurrent blocks where head_count_kv is 0 (a shard of one kind: patch 0011)
    **{arch: CutRules(recurrent=c.all_recurrent) for arch in ("mamba", "mamba2", "falcon-h1")},
    **{arch: _HYBRID for arch in ("jamba", "granitehybrid", "lfm2", "plamo2", "lfm2moe")},
    # (kimi-k3's attention residuals cross a cut through patch 0019: runtime/llamacpp/archs.py)
    **{
        arch: CutRules(recurrent=c.kv0_recurrent, check=c.first_block_heads)
        for arch in ("kimi-linear", "bailingmoe3", "kimi-k3")
    },
    **{arch: CutRules(recurrent=c.nemotron_h_recurrent, check=c.hybrid_check) for arch in _NEMOTRON_H},
    **{arch: CutRules(whole_only=why) for arch, why in WHOLE_ONLY.items()},
}


class Header:
    """The cut rules' view of one model's GGUF metadata (key → value, as ``GGUFModelFile.metadata``): its
    architecture, its rules (None: not one a llama.cpp node runs), block counts and per-block flags, computed on
    first use. ``n_layers``: blocks a route covers (``block_count`` less ``nextn_predict_layers``)."""

    def __init__(self, metadata: dict[str, Any]):
        self.md = metadata
        self.arch = str(metadata.get("general.architecture", ""))
        self.rules = CUT_RULES.get(self.arch)
        self.n_blocks = int(metadata.get(f"{self.arch}.block_count", 0) or 0)
        self.n_layers = self.n_blocks - int(metadata.get(f"{self.arch}.nextn_predict_layers", 0) or 0)

    @cached_property
    def swa(self) -> list[bool] | None:
        """Per-layer sliding-window flags, as llama.cpp computes them (None: no SWA; ``swa_problem`` when llama.cpp
        needs an array the file lacks)."""
        rules, md = self.rules or CutRules(), self.md
        if not (rules.swa_pattern or rules.swa_array) or not md.get(f"{self.arch}.attention.sliding_window"):
            return None
        value = md.get(f"{self.arch}.attention.sliding_window_pattern")
        if isinstance(value, list):
            return [bool(v) for v in value]
        if rules.swa_array:
            return None
        period = int(value) if value is not None else rules.swa_pattern
        if rules.swa_dense_first:
            return [period == 0 or il % period != 0 for il in range(self.n_blocks)]
        return [period == 0 or il % period < period - 1 for il in range(self.n_blocks)]

    @property
    def swa_problem(self) -> str | None:
        """Why the sliding-window layers cannot be known (an architecture needing the array, and a file without)."""
        key = f"{self.arch}.attention.sliding_window_pattern"
        rules = self.rules or CutRules()
        if (
            rules.swa_array
            and self.md.get(f"{self.arch}.attention.sliding_window")
            and not isinstance(self.md.get(key), list)
        ):
            value = self.md.get(key)
            return (
                f"{self.arch}: llama.cpp needs {key} as a per-layer array, and this file has "
                f"{'none' if value is None else 'a scalar'}"
            )
        return None

    @cached_property
    def recurrent(self) -> list[bool] | None:
        """Per-block recurrent flags as llama.cpp computes them (None: no recurrent blocks): ``CutRules.recurrent``;
        else ``attention.recurrent_layers`` when the file has it, else from ``full_attention_interval``
        (``src/models/qwen3next.cpp``: recurrent unless ``(i + 1) % interval == 0``; MTP blocks are not)."""
        rules = self.rules or CutRules()
        if rules.recurrent is not None:
            return rules.recurrent(self)
        if not rules.recurrent_interval:
            return None
        flags = self.md.get(f"{self.arch}.attention.recurrent_layers")
        if isinstance(flags, list):
            return [bool(v) for v in flags]
        interval = int(self.md.get(f"{self.arch}.full_attention_interval", rules.recurrent_interval))
        return [il < self.n_layers and (il + 1) % interval != 0 for il in range(self.n_blocks)]

    @cached_property
    def attention(self) -> list[bool]:
        """Per-block flags of a hybrid model: the block attends (has a KV cache): ``head_count_kv`` > 0 where
        llama.cpp derives the recurrent blocks from other hyperparameters, else every block that is not recurrent
        (nemotron-h: not recurrent and no feed-forward)."""
        recurrent = self.recurrent or [False] * self.n_blocks
        if self.arch in _NEMOTRON_H:  # src/models/nemotron-h.cpp
            ff = c.per_layer(self.md, f"{self.arch}.feed_forward_length", self.n_blocks)
            return [not r and f == 0 for r, f in zip(recurrent, ff)]
        if self.rules is not None and self.rules.recurrent is not None:
            return [k > 0 for k in c.n_head_kv(self)]
        return [not r for r in recurrent]


def residual_streams(metadata: dict[str, Any], cut: int) -> int:
    """Vectors of ``n_embd`` per token in the residual state crossing a cut before block ``cut`` (0: the first block's
    input): ``hyper_connection.count`` streams where the model widens its residual stream (llama.cpp
    ``dsv4_hc_mult``, src/models/deepseek4.cpp; 1 without), plus, with attention residuals (kimi-k3's
    ``attn_res.block_size`` > 0), one per checkpoint banked before the cut, at each block whose index is a multiple
    of the block size (``res_push``, src/models/kimi-k3.cpp): ``ceil(cut / block_size)``."""
    arch = metadata.get("general.architecture", "")
    streams = max(int(metadata.get(f"{arch}.hyper_connection.count", 1) or 1), 1)
    bank = int(metadata.get(f"{arch}.attn_res.block_size", 0) or 0)
    return streams + (-(-cut // bank) if bank > 0 else 0)


def unsupported(arch: str) -> str:
    """The reason a node gives for an architecture outside ``CUT_RULES``."""
    return f"unsupported architecture '{arch}' for the llama.cpp backend (supported: {', '.join(sorted(CUT_RULES))})"


def range_problem(
    header: Header | dict[str, Any],
    start: int,
    end: int,
    head: bool | None = None,
    one_kind: bool = True,
    head_sizes: bool = True,
    indexer_inputs: bool = True,
    block_patterns: bool = True,
) -> str | None:
    """Why blocks ``[start, end)`` cannot be one llama.cpp shard (None: they can), ``head``: with the output head
    (default: when ``end`` is the last layer). In order: an architecture no node runs, a range outside the model, one of
    an architecture that runs only as the whole model, the architecture's own check (of which a DSA model's range
    without an attention / indexer block only where ``indexer_inputs`` is False: a llama.cpp without patch
    ``INDEXER_PATCH``, ``cut_checks.IndexerProblem``; a block pattern counted from a file's block 0 only where
    ``block_patterns`` is False: without ``PATTERN_PATCH``, ``cut_checks.PatternProblem``), a start at a block without
    attention heads where ``head_sizes`` is False (a llama.cpp without patch ``HEADS_PATCH`` reads the head sizes only
    when a file's block 0 has some), and, where ``one_kind`` is False (a llama.cpp without patch ``ONE_KIND_PATCH``:
    ``plan`` assumes the patch queue, a node passes what its libllama carries), a range of one kind of block: without a
    sliding-window layer in a model with them (llama.cpp's is_swa_any; unless the architecture's SWA is optional), or a
    hybrid model's range without a recurrent or an attention block (``cut_checks.OneKindProblem``)."""
    h = header if isinstance(header, Header) else Header(header)
    if h.rules is None:
        return unsupported(h.arch)
    if not 0 <= start < end <= h.n_layers:
        return f"layer range {start}:{end} is outside the model's 0:{h.n_layers}"
    whole = start == 0 and end == h.n_layers and (end == h.n_layers if head is None else head)
    if h.rules.whole_only and not whole:
        return f"{h.arch}: only the whole model runs on the llama.cpp backend: {h.rules.whole_only}"
    problem = h.rules.check(h, start, end) if h.rules.check else None
    if indexer_inputs and isinstance(problem, c.IndexerProblem):
        problem = problem.rest
    if block_patterns and isinstance(problem, c.PatternProblem):
        problem = None
    if problem and not (one_kind and isinstance(problem, c.OneKindProblem)):
        return problem
    heads = h.md.get(f"{h.arch}.attention.head_count")
    if not head_sizes and isinstance(heads, list) and int(heads[start]) == 0 and int(heads[0]) > 0:
        return (
            f"{h.arch}: block {start} has no attention heads, and llama.cpp reads the head sizes "
            f"(attention.key_length, value_length, rope.dimension_count) only when a file's block 0 "
            f"has some (src/llama-model.cpp load_hparams: if (hparams.n_head() > 0)) without patch {HEADS_PATCH} "
            f"(patches/llama.cpp in ggufswarm; `make setup` builds it); a layer range must start at a block with "
            f"attention heads"
        )
    if h.swa_problem:
        return h.swa_problem
    swa = h.swa
    if not one_kind and swa is not None and any(swa) and not any(swa[start:end]) and not h.rules.swa_optional:
        return (
            f"{h.arch}: layer range {start}:{end} holds no sliding-window layer, and llama.cpp's "
            f"memory for a model with sliding-window attention asserts one (src/llama-model.cpp "
            f"create_memory: is_swa_any) without patch {ONE_KIND_PATCH} (patches/llama.cpp in ggufswarm; "
            f"`make setup` builds it); or widen the range (sliding-window layers: "
            f"{', '.join(str(i) for i, w in enumerate(swa) if w)})"
        )
    return None


__all__ = [
    "CUT_RULES",
    "CutRules",
    "DEFAULT_SWA_PERIOD",
    "Header",
    "HEADS_PATCH",
    "INDEXER_PATCH",
    "PATTERN_PATCH",
    "ONE_KIND_PATCH",
    "RANGE_PATCH",
    "WHOLE_ONLY",
    "range_problem",
    "residual_streams",
    "unsupported",
]
