"""Errors of the llama.cpp shard backend (each carries its protocol ``code`` where the node reports one)."""

from __future__ import annotations


class UnsupportedShard(ValueError):
    """The llama.cpp backend cannot run this architecture or this layer range; the message says why."""


class LlamaCppError(RuntimeError):
    """llama.cpp refused a call (model load, context creation, decode); the message says which and why."""


class KVCellsFull(LlamaCppError):
    """No room for a session: all sequence slots taken (``code`` kv_budget_full), a ``max_length`` over
    the cells of one session (kv_budget_too_small), or no free KV cells for a step."""

    def __init__(self, message: str, code: str = "kv_budget_full"):
        super().__init__(message)
        self.code = code


class StateNotAtPosition(LlamaCppError):
    """A shard that truncates only to exact states (recurrent blocks, ``deepseek4``) was asked for a position it
    holds no state checkpoint of (``code`` state_not_at_position); the session is unchanged."""

    code = "state_not_at_position"


__all__ = ["KVCellsFull", "LlamaCppError", "StateNotAtPosition", "UnsupportedShard"]
