"""What every backend's per-session KV cache shares: its position, the max_length check and its errors (no torch).

The torch backend's own cache (growable per-layer buffers) is ``runtime/torch_kv.py``."""

from __future__ import annotations

from ..artifact.accounting import MAX_CONTEXT


class ContextOverflow(ValueError):
    """A step would take a session past its ``max_length`` (or a max_length past the 128K cap); protocol code
    ``context_overflow`` (400)."""

    code = "context_overflow"


class TokenOutOfRange(ValueError):
    """A token id outside ``[0, n_vocab)`` in a step's input or its token-id trailer; protocol code ``bad_token``
    (400)."""

    code = "bad_token"


def check_max_length(max_length: int, model_limit: int = MAX_CONTEXT) -> int:
    """Validate a requested session ``max_length`` (tokens); raises ContextOverflow when out of range."""
    limit = min(model_limit, MAX_CONTEXT)
    if not isinstance(max_length, int) or max_length < 1:
        raise ContextOverflow(f"max_length must be a positive integer, got {max_length!r}")
    if max_length > limit:
        raise ContextOverflow(f"max_length {max_length} exceeds the limit of {limit} tokens")
    return max_length


class KVPosition:
    """What every backend's per-session KV cache shares: ``length`` (tokens held = position of the next
    token), ``max_length`` and the overflow check."""

    length: int
    max_length: int

    def reserve(self, n_tokens: int) -> None:
        """Raise ContextOverflow unless ``n_tokens`` more tokens fit under ``max_length``."""
        if self.length + n_tokens > self.max_length:
            raise ContextOverflow(
                f"session holds {self.length} tokens; {n_tokens} more would exceed max_length {self.max_length}"
            )
