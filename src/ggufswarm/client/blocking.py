"""The blocking route session: an AsyncRouteSession driven on the shared route loop, for the CLI, tests and benches.

No logic of its own: each call runs the async session's coroutine on the loop of client/loop.py and waits.
"""

from __future__ import annotations

import uuid

from . import loop
from .route import RemoteRoute
from .session import AsyncRouteSession
from .telemetry import RouteTelemetry


class RemoteSession:
    """A RouteSession (client/contract.py) on HTTP nodes; see AsyncRouteSession for what each call does and
    raises. Open it with ``RemoteRoute.open``. ``session``: the async session it drives (for code on the
    route loop itself)."""

    def __init__(self, session: AsyncRouteSession):
        self.session = session

    def step(self, token_ids: list[int], sample: bool = True) -> int | None:
        """AsyncRouteSession.step, blocking."""
        return loop.run(self.session.step(token_ids, sample))

    def verify(self, token_ids: list[int]) -> list[int]:
        """AsyncRouteSession.verify, blocking."""
        return loop.run(self.session.verify(token_ids))

    def drop(self, n: int) -> None:
        """AsyncRouteSession.drop (no request)."""
        self.session.drop(n)

    def truncate(self, length: int) -> None:
        """AsyncRouteSession.truncate, blocking."""
        loop.run(self.session.truncate(length))

    def renew(self) -> None:
        """AsyncRouteSession.renew, blocking."""
        loop.run(self.session.renew())

    def close(self) -> None:
        """AsyncRouteSession.close, blocking."""
        loop.run(self.session.close())

    @property
    def telemetry(self) -> RouteTelemetry:
        """AsyncRouteSession.telemetry, blocking (waits up to 1 s for late per-hop replies)."""
        return loop.run(self.session.telemetry())

    @property
    def route(self) -> RemoteRoute:
        """The route as it is now (a repair replaces nodes)."""
        return self.session.route

    @property
    def id(self) -> uuid.UUID:
        return self.session.id

    @property
    def max_length(self) -> int:
        return self.session.max_length

    @property
    def max_verify_tokens(self) -> int:
        return self.session.max_verify_tokens

    @property
    def last_logprobs(self) -> list | None:
        return self.session.last_logprobs

    @property
    def last_token_logprob(self) -> float | None:
        return self.session.last_token_logprob

    @property
    def last_tokens(self) -> list[int] | None:
        return self.session.last_tokens

    @property
    def position(self) -> int:
        """Tokens every node of the route holds."""
        return self.session.position

    @property
    def step_no(self) -> int:
        """Steps sent so far (frames are numbered from 1)."""
        return self.session.step_no

    @property
    def tokens(self) -> list[int]:
        """The history fed so far."""
        return self.session.tokens

    @property
    def repairs(self) -> list[dict]:
        return self.session.repairs
