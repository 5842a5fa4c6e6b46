"""The blocking route session: an AsyncRouteSession driven on the shared route loop, for the CLI, tests and benches.

No logic of its own: each call runs the async session's coroutine on the loop of client/loop.py and waits.
"""

from __future__ import annotations

from . import loop
from .contract import SessionWrapper, forwarded
from .session import AsyncRouteSession
from .telemetry import RouteTelemetry


class RemoteSession(SessionWrapper):
    """A RouteSession (client/contract.py) on HTTP nodes; see AsyncRouteSession for what each call does and
    raises. Open it with ``RemoteRoute.open``. ``session``: the async session it drives (for code on the
    route loop itself); its other members (``max_length``, ``drop``, ``position``, ...) are read through."""

    session: AsyncRouteSession

    def step(self, token_ids: list[int], sample: bool = True) -> int | None:
        """AsyncRouteSession.step, blocking."""
        return loop.run(self.session.step(token_ids, sample))

    def verify(self, token_ids: list[int]) -> list[int]:
        """AsyncRouteSession.verify, blocking."""
        return loop.run(self.session.verify(token_ids))

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

    route = forwarded("route", "The route as it is now (a repair replaces nodes).")
    id = forwarded("id", "The session's id (a random UUID).")
    position = forwarded("position", "Tokens every node of the route holds.")
    step_no = forwarded("step_no", "Steps sent so far (frames are numbered from 1).")
    tokens = forwarded("tokens", "The history fed so far.")
    repairs = forwarded("repairs", "Each repair of the route so far.")
    last_logprobs = forwarded("last_logprobs")
    last_token_logprob = forwarded("last_token_logprob")
    last_tokens = forwarded("last_tokens")
