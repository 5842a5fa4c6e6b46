"""One session's KV cache on a llama.cpp shard (a sequence id of the shard's context), with the exact-state
checkpoints that let a shard llama.cpp cannot truncate partway roll back to positions it saved.

Recurrent shards and ``deepseek4``'s compressed cache cannot roll back partway (``llama_memory_seq_rm`` fails,
``llama_kv_cache_dsv4::seq_rm``): such a shard (``exact_states_only``) truncates only to 0, to its length or to a
*state checkpoint*; anything else raises ``StateNotAtPosition``. docs/protocol.md, "Snapshots and route repair"
("Recurrent shards")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kv import KVPosition, check_max_length
from .errors import LlamaCppError, StateNotAtPosition

if TYPE_CHECKING:
    from .backend import LlamaCppShard


class SeqKV(KVPosition):
    """One session's KV cache on a llama.cpp shard: sequence id ``seq_id`` of ``shard``'s context.

    ``length``: tokens held (= position of the next token); ``epoch`` is bumped by every truncate/restore;
    ``closed`` once ``close`` freed the sequence. Same contract as ``runtime.torch_kv.SessionKV``.
    ``checkpoints``: exact-state shards only, position -> the sequence state (``llama_state_seq_get_data``
    bytes) at exactly that position, oldest first, at most ``shard.checkpoints`` of them.
    """

    def __init__(self, shard: LlamaCppShard, seq_id: int, max_length: int):
        self.shard = shard
        self.seq_id = seq_id
        self.max_length = check_max_length(max_length)
        self.length = 0
        self.epoch = 0
        self.closed = False
        self.checkpoints: dict[int, bytes] = {}

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` tokens (``llama_memory_seq_rm``); ValueError past the end.

        On an exact-state shard (``shard.exact_states_only``) only to 0, ``length`` itself, or a position in
        ``checkpoints`` (the state there is loaded); StateNotAtPosition otherwise (the session is unchanged).
        LlamaCppError when llama.cpp refuses a checkpoint (the session is then empty)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: session holds {self.length} tokens")
        if self.shard.exact_states_only and 0 < length < self.length:
            state = self.checkpoints.get(length)
            if state is None:
                held = sorted(self.checkpoints) or "none"
                raise StateNotAtPosition(
                    f"this shard's state cannot be rolled back to {length} tokens (llama.cpp keeps one recurrent or "
                    f"compressed state per session); exact state checkpoints held: {held}"
                )
            try:
                self.shard.set_seq_state(self.seq_id, state, length)
            except LlamaCppError:  # llama.cpp refused its own state: the sequence is empty now
                self.length, self.checkpoints = 0, {}
                self.epoch += 1
                raise
        else:
            self.shard.seq_remove(self.seq_id, length)
        self.length = length
        self.epoch += 1
        for pos in [p for p in self.checkpoints if p > length]:
            del self.checkpoints[pos]

    def checkpoint(self, state: bytes) -> None:
        """Keep ``state`` (this session's sequence state at ``length`` tokens) as a truncation target (exact-state
        shards only; the oldest is dropped past ``shard.checkpoints``)."""
        if self.shard.exact_states_only and self.length and self.shard.checkpoints:
            self.checkpoints.pop(self.length, None)
            self.checkpoints[self.length] = state
            while len(self.checkpoints) > self.shard.checkpoints:
                del self.checkpoints[next(iter(self.checkpoints))]

    def nbytes(self) -> int:
        """KV bytes this session's tokens occupy in the context."""
        return self.length * self.shard.kv_bytes_per_token()

    def close(self) -> None:
        """Free the sequence's KV cells and its id (idempotent)."""
        if not self.closed:
            self.closed = True
            self.checkpoints = {}
            self.shard.release_seq(self.seq_id)

    def __del__(self):  # a session dropped without close() (e.g. expired) still frees its cells
        try:
            self.close()
        except Exception:  # interpreter shutdown or a freed shard: nothing left to free
            pass


__all__ = ["SeqKV"]
