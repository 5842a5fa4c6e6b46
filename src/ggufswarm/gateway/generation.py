"""Running one request's generation as a task on the gateway's event loop: open a route session (planner), run
``client.generate.agenerate`` on it, and hand its events (Opened, Delta, Done, Failed) to the handler in order.
Cancelling the task (the client went away) stops it at once and closes the session on its nodes."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from ..client.contract import SessionWrapper
from ..client.generate import GenerationStats, agenerate
from ..client.speculative import NgramDrafter
from ..protocol.errors import RouteError
from ..runtime.sampling import SamplingParams
from .errors import CLIENT_GONE, GatewayError, RequestError, as_gateway_error, route_failure, say_repaired
from .params import EOG_BIAS, RequestOptions
from .state import Gateway
from .timings import Clock

log = logging.getLogger(__name__)

SEED_BITS = 62  # a request without a seed gets a random one this wide (SamplingParams.seed)

# A sampled token's logprob entry: (token id, its logprob, [(id, logprob), ...] of the most likely alternatives).
LogprobEntry = tuple[int, float, list]


@dataclass(frozen=True, slots=True)
class Opened:
    """The route session is open (its KV held on every node): the request is accepted."""

    session: object


@dataclass(frozen=True, slots=True)
class Delta:
    """New completion ``text`` (possibly empty) and the logprob ``entries`` of the tokens behind it (empty unless
    the request asked for logprobs; end-of-generation tokens have none); ``timings``: llama-server's timings
    object then (timings.Clock)."""

    text: str
    entries: list[LogprobEntry]
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Done:
    """The generation ended: its ``stats`` (tokens, finish reason), ``telemetry`` object and llama-server's
    ``timings`` object (timings.Clock)."""

    stats: GenerationStats
    telemetry: dict
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Failed:
    """The generation failed with ``error`` (its ``telemetry``, when a session was open) after ``tokens`` tokens."""

    error: GatewayError
    tokens: int


Event = Opened | Delta | Done | Failed


def request_sampling(gw: Gateway, ids: list[int], opts: RequestOptions) -> SamplingParams:
    """The sampling parameters a request's session is opened with: its own, with a seed of our own when it has
    none (a repaired route then draws the same tokens: see Sampler), presence / frequency penalties counting
    generated tokens only (OpenAI), and ``ignore_eos``'s bias on end-of-generation tokens."""
    params = opts.params
    if params.seed is None:
        params = replace(params, seed=secrets.randbits(SEED_BITS))
    params = replace(params, penalize_from=len(ids))  # penalties from the prompt's end on
    if opts.ignore_eos:  # as llama-server: end-of-generation tokens biased to never (over any logit_bias)
        bias = dict(params.logit_bias) | {t: EOG_BIAS for t in gw.tokenizer.eog_ids}
        params = replace(params, logit_bias=tuple(sorted(bias.items())))
    return params


def drafter_for(gw: Gateway, session, opts: RequestOptions):
    """The request's drafter with ``--speculative ngram`` or ``draft`` (close it after the generation): None when
    speculation is off (also per request: ``speculative.n_max`` 0), for requests with logprobs (a verify step
    reports none), on a route whose head cannot verify (an older node), or when the draft model has no free
    session that long: the request is decoded plainly."""
    config = gw.config
    k = config.draft_max if opts.draft_max is None else min(opts.draft_max, config.draft_max)
    if config.speculative == "none" or k < 1 or opts.logprobs or session.max_verify_tokens < 2:
        return None
    k = min(k, session.max_verify_tokens - 1)
    if config.speculative == "draft":
        drafter = gw.draft.drafter(k, session.max_length) if gw.draft is not None else None
        return _SerialDrafter(drafter) if drafter is not None else None
    return NgramDrafter(k)


class _SerialDrafter:
    """A blocking drafter (a draft model's session) whose ``draft`` (in a worker thread: agenerate) and ``close``
    never overlap: a generation cancelled while a draft is in flight frees the draft session once it is done."""

    blocking = True

    def __init__(self, drafter):
        self.drafter, self.method = drafter, drafter.method
        self._lock = threading.Lock()
        self._closed = False

    def draft(self, history: list[int], cap: int | None = None) -> list[int]:
        with self._lock:
            return [] if self._closed else self.drafter.draft(history, cap)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.drafter.close()


async def telemetry(gw: Gateway, session, stats: GenerationStats, watch=None) -> dict:
    """The ``telemetry`` object of a finished generation (ms, tok/s, bytes, tokens; the route as it ended, after
    any repairs, each listed in ``repairs``; ``tainted_by``: the keys of its route's nodes banned while it ran, from
    ``watch``, the verifier's verify.Watch of it)."""
    per_hop = (await session.telemetry()).summary(session.route)
    return {
        "route": session.route.describe(),
        "session": str(session.id),
        "wire_dtype": gw.config.wire_dtype,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "ttft_ms": round(stats.ttft_ms, 2),
        "prefill_tok_s": round(stats.prefill_tok_s, 2),
        "decode_tok_s": round(stats.decode_tok_s, 2),
        **per_hop,
        "speculative": stats.speculative_summary(),
        **gw.verifier.telemetry(watch),
    }


def failure(gw: Gateway, exc: BaseException, session) -> GatewayError:
    """The GatewayError a generation failed with: a route failure says what a gateway without a tracker can do
    about it; with a session open, ``telemetry`` holds what it did before it failed (route, repairs)."""
    tel = None
    if session is not None:
        tel = {"route": session.route.describe(), "session": str(session.id), "repairs": list(session.repairs)}
    if isinstance(exc, RouteError):
        return route_failure(exc, not gw.config.tracker, tel)
    return as_gateway_error(exc, tel)


class _LogprobTap(SessionWrapper):
    """An AsyncSession that keeps a LogprobEntry of each sample of the session it wraps (but end-of-generation
    tokens, in ``skip``) until ``drain``: a request with logprobs."""

    def __init__(self, session, skip=frozenset()):
        super().__init__(session)
        self.skip = skip
        self.entries: list[LogprobEntry] = []
        self.last_logprobs = self.last_token_logprob = self.last_tokens = None

    async def step(self, token_ids):
        token = await self.session.step(token_ids)
        if token is not None and token not in self.skip:
            self.entries.append((token, self.session.last_token_logprob, self.session.last_logprobs or []))
        return token

    async def verify(self, token_ids):
        """The session's verify step (speculative decoding; never with logprobs: drafter_for)."""
        return await self.session.verify(token_ids)

    def drain(self) -> list[LogprobEntry]:
        """The samples kept since the last drain."""
        out, self.entries = self.entries, []
        return out

    async def close(self):
        await self.session.close()


def _no_entries() -> list[LogprobEntry]:
    return []


async def run(
    gw: Gateway, ids: list[int], opts: RequestOptions, emit, prompt_param: str = "prompt", response_id=None
) -> None:
    """Generate the completion of prompt ``ids`` on the running loop: open a route session, then ``emit`` an
    Opened, Deltas, and a Done; or a Failed (cancelled: 499 ``cancelled``, and the CancelledError goes on). The
    session is closed on every node before it returns, also when cancelled, and then handed to the verifier (its
    audits run in the background; ``response_id``: the answer's id, listed should a node of its route be banned)."""
    session, stats, watch = None, GenerationStats(), None
    clock = Clock(stats)
    try:
        session, max_length = await gw.planner.open(gw.http, ids, request_sampling(gw, ids, opts), opts, prompt_param)
        watch = gw.verifier.watch(session, response_id)
        emit(Opened(session))
        # a session holds max_length tokens: the prompt, then every sampled token but the last is fed back
        budget = min(opts.max_tokens, max_length - len(ids) + 1)  # past it the answer ends with "length"
        tap = _LogprobTap(session, gw.tokenizer.eog_ids) if opts.logprobs else None
        drain = tap.drain if tap is not None else _no_entries
        drafter = drafter_for(gw, session, opts)
        # ring decode (client/ring.py), unless --no-ring; a speculative session sends its own steps
        session.decode_ring.on = gw.config.ring and drafter is None
        try:
            async with aclosing(
                agenerate(tap or session, gw.tokenizer, ids, budget, opts.stop, stats, drafter, opts.special)
            ) as deltas:
                async for text in deltas:  # the timings object only where each chunk carries it
                    if opts.timings_per_token:
                        emit(Delta(text, drain(), clock.read()))
                    else:
                        clock.seen()
                        emit(Delta(text, drain()))
        finally:
            if isinstance(drafter, _SerialDrafter):  # waits for a draft in flight: off the loop
                await asyncio.to_thread(drafter.close)
        rest = drain()  # tokens whose text was held back (a stop string) or empty
        timings = clock.read()
        if rest:
            emit(Delta("", rest, timings))
        say_repaired(session.repairs)  # before the answer ends: its reader may look for the line
        emit(Done(stats, await telemetry(gw, session, stats, watch), timings))
    except asyncio.CancelledError:
        if session is not None:
            say_repaired(session.repairs)
        emit(Failed(RequestError("client went away", CLIENT_GONE, "cancelled"), stats.completion_tokens))
        raise
    except Exception as exc:
        if session is not None:
            say_repaired(session.repairs)
        err = failure(gw, exc, session)
        if err.code == "internal":  # a bug: its traceback, to find it by
            log.error("a generation failed after %d tokens", stats.completion_tokens, exc_info=exc)
        emit(Failed(err, stats.completion_tokens))
    finally:
        if session is not None:
            try:
                await session.close()  # finishes releasing on the nodes even when this task is cancelled
            finally:
                gw.timings.observe(session)  # each node's decode time, measured from outside it
                gw.verifier.finish(watch, gw)  # no-op unless verifying; its audits wait for no one


_running: set[asyncio.Task] = set()  # generations in flight (see Generation)


class Generation:
    """One request's generation (``run``) as a task on the running loop; ``next()`` gives its events in order,
    and ``cancel()`` stops it (the handler is done, or the client went away)."""

    def __init__(
        self, gw: Gateway, ids: list[int], opts: RequestOptions, prompt_param: str, response_id: str | None = None
    ):
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(
            run(gw, ids, opts, self._queue.put_nowait, prompt_param, response_id)
        )
        _running.add(self._task)  # the loop holds tasks weakly: a cancelled one still closing its session stays
        self._task.add_done_callback(_running.discard)

    async def next(self) -> Event:
        """The next event (after a Done or a Failed there are none). Cancelling the wait loses no event."""
        return await self._queue.get()

    def cancel(self) -> None:
        """Stop the generation (nothing when it has finished); its session closes on its nodes."""
        self._task.cancel()
