"""A llama.cpp shard's KV cache sized to the sessions it holds where its pages cannot be given back (a GPU's: VRAM has
no zero pages, so patch 0007 does not apply; ``LlamaCppShard.kv_grows``): the context holds streams to the highest
sequence id in use and cells to the longest session's ``max_length``, powers of two; it grows when a session opens
and shrinks after sessions close by copying every open session's state (``llama_state_seq_get_data``) into a new
context. Bitwise: llama.cpp attends over ``n_kv = min(cells, max(256, pad(used, 256)))`` cells of a stream
(``llama_kv_cache::get_n_kv``), the same in any stream of a multiple of 256 cells that holds the session.
docs/memory.md, "A GPU's KV cache"; tests/test_gpu.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .errors import KVCellsFull, LlamaCppError

if TYPE_CHECKING:
    from .backend import LlamaCppShard

KV_STREAM_ROUNDING = 256  # llama.cpp rounds a KV stream's cells up to a multiple of this (src/llama-context.cpp)
STREAMS_PATCH = "0016-seq-state-across-stream-counts"  # a sequence's state loads into another number of streams


class KVShape(NamedTuple):
    """What a context's KV cache holds: ``streams`` (sequence ids 0..streams-1, one KV stream each) of ``cells``
    cells (tokens) each."""

    streams: int
    cells: int

    @property
    def tokens(self) -> int:
        """KV cells in all (tokens)."""
        return self.streams * self.cells


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def shape_for(sessions: dict[int, int], n_seq_max: int, n_ctx_seq: int, streams_grow: bool = True) -> KVShape:
    """The smallest context shape for open sessions ``sessions`` (sequence id → ``max_length``, tokens): streams to
    the highest id, cells to the longest, each a power of two (cells at least KV_STREAM_ROUNDING), within
    ``n_seq_max`` streams of ``n_ctx_seq`` cells (a multiple of KV_STREAM_ROUNDING). No session: one stream of
    KV_STREAM_ROUNDING cells. ``streams_grow`` False (a libllama without STREAMS_PATCH, whose sequence states load
    only into as many streams as they were saved from): always ``n_seq_max`` streams, only the cells grow."""
    streams = min(_pow2_at_least(max(sessions, default=0) + 1), n_seq_max) if streams_grow else n_seq_max
    cells = min(_pow2_at_least(max(max(sessions.values(), default=1), KV_STREAM_ROUNDING)), n_ctx_seq)
    return KVShape(streams, cells)


def grow(shard: LlamaCppShard, seq_id: int, max_length: int) -> None:
    """Make ``shard``'s context hold a new session of ``max_length`` tokens at sequence id ``seq_id`` (the caller
    holds the shard's lock). Raises KVCellsFull (``kv_budget_full``) when the device cannot hold the larger context:
    the shard then holds its sessions as before."""
    wanted = shape_for({**_open(shard), seq_id: max_length}, shard.n_seq_max, shard.n_ctx_seq, streams_grow())
    have = shard.kv_shape
    if wanted.streams <= have.streams and wanted.cells <= have.cells:
        return
    bigger = KVShape(max(wanted.streams, have.streams), max(wanted.cells, have.cells))
    try:
        resize(shard, bigger)
    except LlamaCppError as e:
        raise KVCellsFull(
            f"this node's device cannot hold its sessions' KV cache at {bigger.streams} streams of {bigger.cells} "
            f"cells ({bigger.tokens * shard.kv_bytes_per_token() >> 20} MiB): {e}",
            "kv_budget_full",
        ) from e


def device_tokens(shard: LlamaCppShard) -> int | None:
    """KV tokens the shard's GPU could hold for its sessions now: its free memory less ``FIT_MARGIN_BYTES`` (compute
    buffers, the driver), plus the KV cache the context holds there, over the KV bytes a token costs in the blocks on
    it (tokens); None where the KV cache does not grow (``kv_grows``) or the device is not listed."""
    from ...artifact.accounting import shard_account
    from ...artifact.planning import FIT_MARGIN_BYTES
    from .devices import devices

    if not shard.kv_grows:
        return None
    now = next((d for d in devices() if d.handle == shard.device.handle), None)
    per_token = shard_account(shard.model, shard.spec.end - shard.gpu_blocks, shard.spec.end).kv_bytes_per_token
    if now is None or per_token <= 0:
        return None
    held = shard.placement.buffers.get(now.name, {}).get("KV", 0)
    return max(now.free_bytes - FIT_MARGIN_BYTES + held, 0) // per_token


def fit(shard: LlamaCppShard) -> bool:
    """Shrink ``shard``'s context to its open sessions' shape where that holds under half its cells (after sessions
    closed); whether it did. Never during a step (the caller holds no step: it takes the shard's lock). A context
    the device refuses to make leaves the one before it (``resize``)."""
    with shard.step_lock:
        if not shard.kv_grows or shard.closed:
            return False
        wanted = shape_for(_open(shard), shard.n_seq_max, shard.n_ctx_seq, streams_grow())
        if 2 * wanted.tokens > shard.kv_shape.tokens:
            return False
        try:
            resize(shard, wanted)
        except LlamaCppError:
            return False
        return True


def streams_grow() -> bool:
    from .patches import applied

    return applied(STREAMS_PATCH)


def _open(shard: LlamaCppShard) -> dict[int, int]:
    return {kv.seq_id: kv.max_length for kv in list(shard._sessions) if not kv.closed}


def resize(shard: LlamaCppShard, shape: KVShape) -> None:
    """Copy ``shard``'s open sessions into a new context of ``shape`` (the caller holds the shard's lock). Raises
    LlamaCppError when llama.cpp cannot make it or take a session back; the shard then has a context of its shape
    before, holding the same sessions (where even that cannot be made again: one of KV_STREAM_ROUNDING cells a
    stream, its sessions emptied, ``_empty``)."""
    held = [(kv, shard.seq_state(kv.seq_id)) for kv in list(shard._sessions) if not kv.closed and kv.length]
    before = shard.kv_shape
    shard.free_context()
    try:
        shard.make_context(shape)
    except LlamaCppError:
        try:
            shard.make_context(before)
        except LlamaCppError:  # another process took the device meanwhile: never leave the shard without a context
            shard.make_context(KVShape(before.streams, KV_STREAM_ROUNDING))
            for kv, _ in held:
                _empty(kv)
            raise
        _restore(shard, held)
        raise
    _restore(shard, held)


def _empty(kv) -> None:
    """A session whose cells are gone: length 0 (its next step is a position mismatch its client repairs)."""
    kv.length, kv.checkpoints = 0, {}
    kv.epoch += 1


def _restore(shard: LlamaCppShard, held: list) -> None:
    """Load each ``(session, state)`` back; a session llama.cpp refuses is left empty at length 0 (its next step is a
    position mismatch, which its client repairs), never at a length whose cells it lost; LlamaCppError after all."""
    refused = []
    for kv, state in held:
        try:
            shard.set_seq_state(kv.seq_id, state, kv.length)
        except LlamaCppError as e:
            _empty(kv)
            refused.append(f"sequence {kv.seq_id}: {e}")
    if refused:
        raise LlamaCppError("; ".join(refused))


__all__ = [
    "KV_STREAM_ROUNDING",
    "KVShape",
    "STREAMS_PATCH",
    "device_tokens",
    "fit",
    "grow",
    "resize",
    "shape_for",
    "streams_grow",
]
