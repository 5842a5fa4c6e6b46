"""Memory and wire accounting of a GGUF model's shards from its header alone (metadata + tensor table).

Nothing here loads a weight: every number comes from GGUF metadata keys and the tensor table (which ranges can be a
shard: the node's own cut rules, ``cut_rules``). A node computes its shard's numbers with this module and advertises
them; the tracker and ``ggufswarm plan`` work from the numbers alone. What each number counts, and where llama.cpp
computes it: docs/protocol.md, "Shard accounting" ("How a block is counted")."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .cut_rules import DEFAULT_SWA_PERIOD, Header, residual_streams
from .cut_rules import range_problem as cut_problem

MAX_CONTEXT = 131072  # product hard cap on a session's max_length (128K tokens)
KV_ELEMENT_BYTES = 2  # f16: llama.cpp's default type_k / type_v (common/common.h)
STATE_ELEMENT_BYTES = 4  # f32: llama.cpp's recurrent r/s state type (llama_model::create_memory)
WIRE_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
FRAME_HEADER_BYTES = 48  # protocol/frame.py HEADER_SIZE
TRAILER_BYTES_PER_TOKEN = 4  # int32 token id per token (flag bit 0)

EMBED_TENSORS = ("token_embd.weight",)
# the head stage: output norm and LM head, and DeepSeek-V4's hyper-connection collapse of the residual streams
# (output_hc_*, src/models/deepseek4.cpp build_hc_head), which only the last shard loads (llama.cpp patch 0002)
HEAD_TENSORS = (
    "output_norm.weight",
    "output_norm.bias",
    "output.weight",
    "output.bias",
    "output_hc_fn.weight",
    "output_hc_base.weight",
    "output_hc_scale.weight",
)
_RECURRENT_MARKERS = (".ssm_", ".time_mix_", ".shortconv.", ".channel_mix_")
_ATTENTION_MARKERS = (".attn_q.", ".attn_k.", ".attn_qkv.", ".attn_kv_a_mqa.", ".attn_q_a.", ".attn_kv.")


class AccountingError(ValueError):
    """The header lacks what the accounting needs (no ``general.architecture``, no ``block_count``,
    no ``embedding_length``)."""


@dataclass(frozen=True)
class LayerAccount:
    """One block: ``kind`` is ``attention``, ``mla``, ``compressed``, ``recurrent`` or ``none`` (no KV,
    no state); sizes in bytes (``kv_bytes_per_token`` per token of context, ``state_bytes_per_session``
    per session, ``weight_bytes`` encoded). ``cut_before``: a shard may start at this block (False for a
    block that reuses what an earlier block computed, e.g. a DSA block without an indexer of its own,
    which takes the previous indexer's top-k)."""

    index: int
    kind: str
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_session: int
    cut_before: bool = True


@dataclass(frozen=True)
class ShardAccount:
    """What a shard ``layers = (start, end)`` (half-open) with the embedding (``embed``) and/or head
    (``head``) stage costs. All sizes in bytes:

    ``weight_bytes``: encoded bytes of every tensor the shard loads: its blocks, ``token_embd`` when
    ``embed``, ``output_norm`` and ``output`` (or the tied ``token_embd``) when ``head``, and the
    global tensors every shard needs (e.g. ``rope_freqs``). ``kv_bytes_per_token``: KV cache per token of
    one session's context; ``state_bytes_per_session``: fixed per-session state (recurrent layers);
    ``boundary_bytes_per_token``: the hidden state this shard sends per token (``n_embd`` × element size
    of ``wire_dtype``; 0 for the head, which sends a token id back).
    """

    layers: tuple[int, int]
    embed: bool
    head: bool
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_session: int
    boundary_bytes_per_token: int
    n_embd: int
    wire_dtype: str = "f32"

    def session_bytes(self, tokens: int) -> int:
        """Bytes one session of ``tokens`` context costs on this shard: KV plus its fixed state."""
        return tokens * self.kv_bytes_per_token + self.state_bytes_per_session

    def to_json(self) -> dict:
        """The advertised form (``layers`` as a list)."""
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


def _layer_of(name: str) -> int | None:
    if name.startswith("blk."):
        part = name.split(".", 2)[1]
        return int(part) if part.isdigit() else None
    return None


class HeaderAccounts:
    """Per-block and per-shard accounting of one GGUF model from ``metadata`` (key → value, as
    ``GGUFModelFile.metadata``) and ``tensors`` (``(name, encoded bytes)`` pairs, the whole table).

    ``n_layers``: blocks a route covers (``block_count`` less ``nextn_predict_layers``);
    ``layers``: a ``LayerAccount`` for every block ``0 .. block_count - 1``; ``global_bytes``: name → bytes
    of the tensors outside blocks. Raises AccountingError when a needed key is missing.
    """

    def __init__(self, metadata: dict[str, Any], tensors: Iterable[tuple[str, int]]):
        self.metadata = metadata
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise AccountingError("GGUF header has no general.architecture key")
        self.arch = arch
        try:
            self.n_blocks = int(metadata[f"{arch}.block_count"])
            self.n_embd = int(metadata[f"{arch}.embedding_length"])
        except KeyError as exc:
            raise AccountingError(f"GGUF header has no {exc.args[0]} key") from None
        self.n_layers = self.n_blocks - int(metadata.get(f"{arch}.nextn_predict_layers", 0) or 0)
        block_bytes = [0] * self.n_blocks
        names: list[set[str]] = [set() for _ in range(self.n_blocks)]
        self.global_bytes: dict[str, int] = {}
        self.other_block_bytes = 0  # blk.N with N >= block_count (should not happen; kept so totals add up)
        for name, n_bytes in tensors:
            il = _layer_of(name)
            if il is None:
                self.global_bytes[name] = self.global_bytes.get(name, 0) + int(n_bytes)
            elif il < self.n_blocks:
                block_bytes[il] += int(n_bytes)
                names[il].add(name)
            else:
                self.other_block_bytes += int(n_bytes)
        self.cuts = Header(metadata)  # the cut rules' view of the header (range_problem)
        self.layers = [self._layer(il, block_bytes[il], names[il]) for il in range(self.n_blocks)]
        self._problems: dict[tuple[int, int], str | None] = {}

    # -- metadata helpers ------------------------------------------------------------------------
    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def _per_layer(self, key: str, il: int, default: int) -> int:
        v = self._get(key, default)
        if isinstance(v, list):
            return int(v[il]) if il < len(v) else default
        return int(v)

    def _has_recurrent_metadata(self) -> bool:
        return any(
            self._get(k)
            for k in ("ssm.state_size", "ssm.inner_size", "wkv.head_size", "shortconv.l_cache", "kda.head_dim")
        )

    def _is_swa(self, il: int) -> bool:
        pattern = self._get("attention.sliding_window_pattern")
        if not self._get("attention.sliding_window"):
            return False
        if isinstance(pattern, list):
            return bool(pattern[il]) if il < len(pattern) else False
        if pattern is None:
            pattern = DEFAULT_SWA_PERIOD.get(self.arch)
            if pattern is None:
                return False
        n = int(pattern)
        return n == 0 or il % n < n - 1  # llama_hparams::set_swa_pattern

    def _is_recurrent(self, il: int, names: set[str]) -> bool:
        flags = self._get("attention.recurrent_layers")
        if isinstance(flags, list):
            return bool(flags[il]) if il < len(flags) else False
        if not self._has_recurrent_metadata():
            # an interval the architecture's cut rules know though the header says nothing (minimax-01's
            # lightning-attention blocks: all but every 8th, src/models/minimax-01.cpp)
            rules, recurrent = self.cuts.rules, self.cuts.recurrent
            return bool(rules and rules.recurrent_interval and recurrent and il < len(recurrent) and recurrent[il])
        interval = self._get("full_attention_interval")
        if interval:  # src/models/qwen3next.cpp, qwen35*.cpp
            return il < self.n_layers and (il + 1) % int(interval) != 0
        recurrent_tensors = any(m in n for n in names for m in _RECURRENT_MARKERS)
        attention_tensors = any(m in n for n in names for m in _ATTENTION_MARKERS)
        if recurrent_tensors and not attention_tensors:
            return True
        return self._n_head_kv(il) == 0 and not attention_tensors

    def _n_head_kv(self, il: int) -> int:
        n_head = self._per_layer("attention.head_count", il, 0)
        return self._per_layer("attention.head_count_kv", il, n_head)

    def _state_elements(self) -> int:
        """``n_embd_r() + n_embd_s()`` of one recurrent layer (src/llama-hparams.cpp; allocated in
        src/llama-memory-recurrent.cpp)."""
        head_size = int(self._get("wkv.head_size", 0) or 0)
        if head_size:
            return int(self._get("token_shift_count", 2)) * self.n_embd + self.n_embd * head_size
        l_cache = int(self._get("shortconv.l_cache", 0) or 0)
        if l_cache:
            return self.n_embd * (l_cache - 1)
        n_head = self._per_layer("attention.head_count", 0, 0)  # hparams.n_head(): block 0's
        kda = int(self._get("kda.head_dim", 0) or 0)
        if kda:  # Kimi's KDA: Q, K and V convolution states, and a [head_dim, head_dim] state per head
            d_conv = int(self._get("ssm.conv_kernel", 0) or 0)
            return 3 * (d_conv - 1 if d_conv > 0 else 3) * n_head * kda + kda * kda * n_head
        if self.arch == "minimax-01" and n_head:  # lightning attention: a [head_dim, head_dim] state per head
            head_dim = int(self._get("attention.key_length", 0) or 0) or self.n_embd // n_head
            return head_dim * head_dim * n_head
        d_conv = int(self._get("ssm.conv_kernel", 0) or 0)
        d_inner = int(self._get("ssm.inner_size", 0) or 0)
        d_state = int(self._get("ssm.state_size", 0) or 0)
        n_group = int(self._get("ssm.group_count", 0) or 0)
        return max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state) + d_state * d_inner

    def _layer(self, il: int, weight: int, names: set[str]) -> LayerAccount:
        # KV per token: n_embd_k_gqa + n_embd_v_gqa per cell (src/llama-kv-cache.cpp llama_kv_cache constructor,
        # src/llama-hparams.cpp); a shared-KV block: the reuse map of create_memory (src/llama-model.cpp)
        if self._is_recurrent(il, names):
            return LayerAccount(il, "recurrent", weight, 0, self._state_elements() * STATE_ELEMENT_BYTES)
        n_kv = self._n_head_kv(il)
        ratios = self._get("attention.compress_ratios")
        compressed_model = isinstance(ratios, list)  # llama-kv-cache-dsv4.cpp: every cache K-only
        kv_lora = self._get("attention.kv_lora_rank")
        shared_kv = int(self._get("attention.shared_kv_layers", 0) or 0)  # the last blocks of the trunk
        if kv_lora:  # MLA: K only, the latent plus the rope part (llama-kv-cache.cpp: has_v = !is_mla)
            k_elems = int(kv_lora) + int(self._get("rope.dimension_count", 0) or 0)
            v_elems, kind = 0, "mla"
        elif n_kv == 0 or self.n_layers - shared_kv <= il < self.n_layers:
            return LayerAccount(il, "none", weight, 0, 0)  # no heads, or a shared-KV block (reuses another's cache)
        else:
            n_head = self._per_layer("attention.head_count", il, 0) or 1
            swa = self._is_swa(il)
            k = (
                int(self._get("attention.key_length_swa" if swa else "attention.key_length", 0) or 0)
                or int(self._get("attention.key_length", 0) or 0)
                or self.n_embd // n_head
            )
            v = (
                int(self._get("attention.value_length_swa" if swa else "attention.value_length", 0) or 0)
                or int(self._get("attention.value_length", 0) or 0)
                or self.n_embd // n_head
            )
            k_elems, v_elems, kind = n_kv * k, 0 if compressed_model else n_kv * v, "attention"
        row = (k_elems + v_elems) * KV_ELEMENT_BYTES
        idx_elems = int(self._get("attention.indexer.key_length", 0) or 0)  # src/llama-memory-hybrid-idx.cpp
        shared_indexer = False
        if idx_elems and names and not any(".indexer" in n for n in names):
            idx_elems = 0  # this block has no indexer of its own (the tensor table says)
            shared_indexer = kind == "mla"  # it attends over the top-k of the previous indexer block
        ratio = int(ratios[il]) if compressed_model and il < len(ratios) else 0
        if ratio > 1:
            # raw rows of every position (swa_full), one compressed K row per `ratio` tokens, and as many indexer
            # rows (dsv4_comp_size); per session the compressor's kv + score state (src/llama-kv-cache-dsv4.cpp,
            # llama_dsv4_comp_state: overlapping, 2 * ratio rows of twice the width, where the block has an indexer)
            overlap = 2 if idx_elems else 1
            per_token = row + math.ceil(row / ratio) + math.ceil(idx_elems * KV_ELEMENT_BYTES / ratio)
            state = 2 * (overlap * ratio) * (overlap * k_elems) * STATE_ELEMENT_BYTES
            if idx_elems:
                state += 2 * (2 * ratio) * (2 * idx_elems) * STATE_ELEMENT_BYTES
            return LayerAccount(il, "compressed", weight, per_token, state)
        return LayerAccount(il, kind, weight, row + idx_elems * KV_ELEMENT_BYTES, 0, not shared_indexer)

    def range_problem(self, start: int, end: int) -> str | None:
        """Why blocks ``[start, end)`` (the head with the last block) cannot be one shard (None: they can): the cut
        rules a node checks at start (``cut_rules.range_problem``, from the header alone), so every range ``plan``
        places is one the node accepts."""
        key = (start, end)
        if key not in self._problems:
            self._problems[key] = cut_problem(self.cuts, start, end)
        return self._problems[key]

    # -- shards ----------------------------------------------------------------------------------
    @property
    def embed_bytes(self) -> int:
        """Encoded bytes of the embedding stage (``token_embd``)."""
        return sum(self.global_bytes.get(n, 0) for n in EMBED_TENSORS)

    @property
    def head_bytes(self) -> int:
        """Encoded bytes of the head stage: ``output_norm`` + ``output`` (``token_embd`` when the output
        is tied to it)."""
        tied = "output.weight" not in self.global_bytes
        return sum(self.global_bytes.get(n, 0) for n in HEAD_TENSORS) + (self.embed_bytes if tied else 0)

    @property
    def shared_bytes(self) -> int:
        """Encoded bytes of the global tensors every shard loads (neither embedding nor head, e.g.
        ``rope_freqs``)."""
        return sum(b for n, b in self.global_bytes.items() if n not in EMBED_TENSORS + HEAD_TENSORS)

    @property
    def total_bytes(self) -> int:
        """Encoded bytes of every tensor in the table."""
        blocks = sum(layer.weight_bytes for layer in self.layers)
        return blocks + sum(self.global_bytes.values()) + self.other_block_bytes

    def boundary_width_at(self, cut: int) -> int:
        """Values per token of the residual state crossing a shard boundary before block ``cut``: ``n_embd`` times
        ``cut_rules.residual_streams`` (hyper-connection streams, attention-residual checkpoints)."""
        return self.n_embd * residual_streams(self.metadata, cut)

    @property
    def boundary_width(self) -> int:
        """The widest ``boundary_width_at`` over the model's inner cuts (every cut's, but for kimi-k3's banked
        checkpoints: the last cut's)."""
        return self.boundary_width_at(max(self.n_layers - 1, 0))

    def boundary_bytes_per_token(self, wire_dtype: str = "f32", cut: int | None = None) -> int:
        """Hidden-state bytes per token crossing the shard boundary before block ``cut`` (None: the widest):
        ``boundary_width_at`` × element size."""
        try:
            size = WIRE_ELEMENT_BYTES[wire_dtype]
        except KeyError:
            raise ValueError(f"unknown wire dtype {wire_dtype!r} (known: {', '.join(WIRE_ELEMENT_BYTES)})") from None
        return (self.boundary_width if cut is None else self.boundary_width_at(cut)) * size

    def shard(
        self, start: int, end: int, embed: bool = False, head: bool = False, wire_dtype: str = "f32"
    ) -> ShardAccount:
        """The ``ShardAccount`` of blocks ``[start, end)``; ValueError for a range outside ``0:n_blocks``."""
        if not 0 <= start <= end <= self.n_blocks:
            raise ValueError(f"layer range {start}:{end} is outside the model's 0:{self.n_blocks}")
        blocks = self.layers[start:end]
        weight = sum(layer.weight_bytes for layer in blocks) + self.shared_bytes
        if embed:
            weight += self.embed_bytes
        if head:
            weight += self.head_bytes - (self.embed_bytes if embed and "output.weight" not in self.global_bytes else 0)
        return ShardAccount(
            (start, end),
            embed,
            head,
            weight,
            sum(layer.kv_bytes_per_token for layer in blocks),
            sum(layer.state_bytes_per_session for layer in blocks),
            0 if head else self.boundary_bytes_per_token(wire_dtype, end),
            self.n_embd,
            wire_dtype,
        )

    @classmethod
    def from_model(cls, model) -> HeaderAccounts:
        """From a ``GGUFModelFile`` (its metadata and tensor table; no tensor data is read)."""
        return cls(model.metadata, ((t.name, t.n_bytes) for t in model.tensors.values()))


def shard_account(
    model, start: int, end: int, embed: bool = False, head: bool = False, wire_dtype: str = "f32"
) -> ShardAccount:
    """``HeaderAccounts.from_model(model).shard(...)`` for a ``GGUFModelFile``."""
    return HeaderAccounts.from_model(model).shard(start, end, embed, head, wire_dtype)


__all__ = [
    "AccountingError",
    "HeaderAccounts",
    "KV_ELEMENT_BYTES",
    "LayerAccount",
    "STATE_ELEMENT_BYTES",
    "ShardAccount",
    "WIRE_ELEMENT_BYTES",
    "shard_account",
]
