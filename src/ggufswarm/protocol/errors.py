"""Machine-readable error codes of the node and gateway protocol, their HTTP statuses, and the JSON body."""

from __future__ import annotations

import json

# code -> HTTP status (docs/protocol.md, "Errors")
ERROR_STATUS = {
    "bad_request": 400,         # JSON body missing / malformed / wrong field types
    "bad_frame": 400,           # frame too short, bad magic, lengths that do not add up
    "unsupported_version": 400, # frame protocol version this node does not speak
    "bad_dtype": 400,           # unknown dtype code, or a dtype this shard does not take (ids vs hidden)
    "bad_shape": 400,           # n_embd differs from the model's, or n_tokens == 0
    "bad_token": 400,           # token id outside the vocabulary
    "non_finite": 400,          # a frame carries NaN/inf
    "context_overflow": 400,    # the step would pass the session's max_length
    "unknown_session": 404,     # no such session on this node (never opened, closed or expired)
    "session_exists": 409,      # open with an id already in use
    "step_conflict": 409,       # same step number, different content
    "stale_step": 409,          # step number below the last one applied
    "step_gap": 409,            # step number skips ahead
    "position_mismatch": 409,   # frame start position != tokens the session holds
    "too_many_tokens": 413,     # n_tokens above the node's max_step_tokens
    "kv_budget_full": 429,      # the node's KV budget is taken by other sessions: retry later
    "kv_budget_too_small": 503, # this session's max_length alone exceeds the node's whole budget
    "internal": 500,            # a bug; the message says what
    "hop_failed": 502,          # the next hop answered with an error or dropped the connection
    "hop_timeout": 504,         # the next hop did not answer within the hop timeout
}


class ProtocolError(Exception):
    """An error with a machine-readable ``code`` (a key of ERROR_STATUS) and an HTTP ``status``."""

    def __init__(self, code: str, message: str, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status or ERROR_STATUS.get(code, 500)

    def body(self) -> bytes:
        """The JSON error body ``{"error": {"code", "message"}}`` (UTF-8)."""
        return error_body(self.code, self.message)


def error_body(code: str, message: str) -> bytes:
    """``{"error": {"code": code, "message": message}}`` as UTF-8 JSON bytes."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()
