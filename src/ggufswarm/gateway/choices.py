"""The ``n`` choices of one request, run at once: each its own Generation (its own route session, KV on every node)
with its own seed (params.choice_seed), and their events merged in the order they come, tagged with the index."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace

from .generation import Done, Event, Failed, Generation, Opened
from .params import RequestOptions, choice_seed
from .state import Gateway


def choice_options(opts: RequestOptions, index: int) -> RequestOptions:
    """The options choice ``index`` is generated with: the request's, its seed derived by ``choice_seed``."""
    if index == 0:
        return opts
    return replace(opts, params=replace(opts.params, seed=choice_seed(opts.params.seed, index)))


class Choices:
    """``opts.n`` generations of prompt ``ids``; ``next()`` gives ``(index, event)`` in arrival order (each
    choice's own events in order), ``opened()`` waits until every session is open, ``cancel()`` stops them all.
    Why one session per choice, not one forked: docs/protocol.md, "n"."""

    def __init__(
        self, gw: Gateway, ids: list[int], opts: RequestOptions, prompt_param: str, response_id: str | None = None
    ):
        self.n = opts.n
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._held: deque[tuple[int, Event]] = deque()  # events that came while opened() waited
        self._generations = [
            Generation(gw, ids, choice_options(opts, i), prompt_param, response_id) for i in range(opts.n)
        ]
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(i, g)) for i, g in enumerate(self._generations)]

    async def _pump(self, index: int, generation: Generation) -> None:
        while True:
            event = await generation.next()
            self._queue.put_nowait((index, event))
            if isinstance(event, (Done, Failed)):
                return

    async def next(self) -> tuple[int, Event]:
        """The next ``(choice index, event)``. Cancelling the wait loses no event."""
        if self._held:
            return self._held.popleft()
        return await self._queue.get()

    async def opened(self, wait) -> Failed | None:
        """Wait (``wait(self)``: intake.next_while_connected, which raises ConnectionResetError when the client
        left) until every choice's session is open: None, or the first Failed."""
        waiting, incoming = set(range(self.n)), _Incoming(self._queue)
        while waiting:
            index, event = await wait(incoming)
            if isinstance(event, Failed):
                return event
            if isinstance(event, Opened):
                waiting.discard(index)
            else:
                self._held.append((index, event))
        return None

    def cancel(self) -> None:
        """Stop every choice (nothing for those that finished); their sessions close on their nodes."""
        for pump in self._pumps:
            pump.cancel()
        for generation in self._generations:
            generation.cancel()


class _Incoming:
    """The merged queue seen as a generation (``next()``), for intake.next_while_connected."""

    def __init__(self, queue: asyncio.Queue):
        self.next = queue.get


__all__ = ["Choices", "choice_options"]
