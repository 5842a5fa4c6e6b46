"""A llama.cpp shard's sessions as llama.cpp serializes them (``llama_state_seq_*``): snapshots, exact-state
checkpoints, and the copies that resize a KV cache (``kv_size``). docs/protocol.md, "Snapshots and route repair"."""

from __future__ import annotations

import ctypes
import threading

from ..kv import ContextOverflow
from .bindings import L
from .errors import LlamaCppError
from .seq import SeqKV


class SeqStates:
    """LlamaCppShard's sequence states (a mixin: its ``_ctx``, ``_mem`` and step lock ``_lock``)."""

    _ctx: ctypes.c_void_p
    _mem: ctypes.c_void_p
    _lock: threading.RLock

    def seq_state(self, seq_id: int) -> bytes:
        """Sequence ``seq_id``'s KV cells (and recurrent state) as llama.cpp serializes them
        (``llama_state_seq_get_data``). LlamaCppError when llama.cpp writes short."""
        with self._lock:
            size = L.llama_state_seq_get_size(self._ctx, seq_id)
            buf = (ctypes.c_uint8 * size)()
            got = L.llama_state_seq_get_data(self._ctx, buf, size, seq_id)
        if got != size:
            raise LlamaCppError(f"llama.cpp wrote {got} of {size} state bytes")
        return bytes(buf)

    def state_bytes(self, kv: SeqKV) -> bytes:
        """The session's state (``seq_state``), kept as its checkpoint at its length on an exact-state shard."""
        data = self.seq_state(kv.seq_id)
        kv.checkpoint(data)
        return data

    def set_seq_state(self, seq_id: int, data: bytes, n_tokens: int) -> None:
        """Load a sequence state holding exactly ``n_tokens`` tokens into sequence ``seq_id`` (LlamaCppError, the
        sequence then empty, when llama.cpp rejects it); the session's ``length`` is the caller's to set."""
        src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        with self._lock:
            L.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            got = L.llama_state_seq_set_data(self._ctx, src, len(data), seq_id)
            held = L.llama_memory_seq_pos_max(self._mem, seq_id) + 1
            if got == 0 or held != n_tokens:
                L.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
                raise LlamaCppError(
                    f"llama.cpp rejected the state ({len(data)} bytes; holds {held} tokens, expected {n_tokens})"
                )

    def load_state(self, kv: SeqKV, data: bytes, n_tokens: int) -> None:
        """Replace the session's KV with a state from ``state_bytes`` holding ``n_tokens`` tokens.

        Raises ContextOverflow past ``max_length`` and LlamaCppError when llama.cpp rejects the data
        (the session is then empty).
        """
        if n_tokens > kv.max_length:
            raise ContextOverflow(f"snapshot holds {n_tokens} tokens; the session's max_length is {kv.max_length}")
        kv.epoch += 1
        kv.checkpoints = {}
        try:
            self.set_seq_state(kv.seq_id, data, n_tokens)
        except LlamaCppError:
            kv.length = 0
            raise
        kv.length = n_tokens
        kv.checkpoint(data)


__all__ = ["SeqStates"]
