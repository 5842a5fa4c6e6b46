"""What the generation loop needs of a route session and a drafter: the typing.Protocols they implement.

``RouteSession``: blocking (LocalSession in client/generate.py, RemoteSession in client/blocking.py), used by
``generate``. ``AsyncSession``: the same on an event loop (AsyncRouteSession in client/session.py), used by
``agenerate``. ``Drafter``: client/speculative.py's NgramDrafter and ModelDrafter.

``SessionWrapper`` (with ``forwarded``) is the base of the sessions that wrap another one and pass its members
through: RemoteSession, generate's blocking adapter, the gateway's logprob tap.
"""

from __future__ import annotations

from typing import Protocol


def forwarded(name: str, doc: str | None = None) -> property:
    """A read-only property that reads attribute ``name`` of the wrapped session (``self.session``)."""
    return property(lambda self: getattr(self.session, name), doc=doc or f"The wrapped session's ``{name}``.")


class SessionWrapper:
    """A session that wraps another, ``session``: its length limits and ``drop`` are the wrapped session's."""

    def __init__(self, session):
        self.session = session

    max_length = forwarded("max_length", "Tokens the session may hold.")
    max_verify_tokens = forwarded("max_verify_tokens", "Most tokens of one ``verify`` step (0: it cannot verify).")

    def drop(self, n: int) -> None:
        """Forget the last ``n`` tokens fed (the wrapped session's ``drop``)."""
        self.session.drop(n)


class RouteSession(Protocol):
    """A session on a route: feeds token ids in, gets the head's sampled token id out."""

    @property
    def max_length(self) -> int:
        """Tokens the session may hold."""

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens of one ``verify`` step (0: the route cannot verify)."""

    last_logprobs: list | None  # the last sample's top ``[id, logprob]`` pairs (sessions opened with top_logprobs)
    last_token_logprob: float | None  # the last sample's logprob (sessions opened with logprobs)
    last_tokens: list[int] | None  # the last verify step's samples, one per position

    def step(self, token_ids: list[int]) -> int:
        """Prefill (several ids) or decode (one id) through the whole route; returns the next token id."""

    def verify(self, token_ids: list[int]) -> list[int]:
        """Feed ``token_ids`` as one step, sampling after every position (speculative decoding): the token a
        one-token step would sample after each, ``[len(token_ids)]``."""

    def drop(self, n: int) -> None:
        """Forget the last ``n`` tokens fed (a verify step's rejected drafts)."""

    def close(self) -> None:
        """Release the session's KV cache on every shard."""


class AsyncSession(Protocol):
    """A RouteSession on an event loop: ``step``, ``verify`` and ``close`` are coroutines."""

    @property
    def max_length(self) -> int:
        """Tokens the session may hold."""

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens of one ``verify`` step (0: the route cannot verify)."""

    last_logprobs: list | None
    last_token_logprob: float | None
    last_tokens: list[int] | None

    async def step(self, token_ids: list[int]) -> int:
        """RouteSession.step."""

    async def verify(self, token_ids: list[int]) -> list[int]:
        """RouteSession.verify."""

    def drop(self, n: int) -> None:
        """RouteSession.drop (no request: the next step's frame rewinds)."""

    async def close(self) -> None:
        """RouteSession.close."""


class Drafter(Protocol):
    """Proposes tokens to verify (client/speculative.py)."""

    method: str  # the ``speculative`` telemetry's method: "ngram" or "draft"
    blocking: bool  # drafting computes long enough (a model) to run in a worker thread off the event loop

    def draft(self, history: list[int], cap: int | None = None) -> list[int]:
        """Up to ``min(k, cap)`` drafted continuations of ``history`` (token ids)."""
