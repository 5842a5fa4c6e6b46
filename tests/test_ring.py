"""Ring decode (client/ring.py, node/ring.py): the head sends each next decode step to the route's first node itself.

Each test compares a ring session with one whose client sends every step (``ring=False``) on the same nodes: the
tokens must be the same, and the ring must have carried the decode steps (``ring_steps``). The route-repair case
(a node SIGKILLed mid-stream, the gateway's ring sessions) is test_faults.py's kill suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request

import aiohttp
import pytest
from route_fixtures import cluster, health, tiny_split_route  # noqa: F401  (cluster: a shared fixture)
from tinymodels import write_tiny_model

from ggufswarm.client.generate import GenerationStats, agenerate, generate
from ggufswarm.client.grammar import response_format_grammar
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.speculative import NgramDrafter
from ggufswarm.protocol import encode_tokens
from ggufswarm.protocol.link import NO_KEY, decode_reply
from ggufswarm.runtime.sampling import SamplingParams

PROMPT = "The capital of France is"
N = 24  # tokens generated per run


def run(urls: list[str], tokenizer, ids: list[int], sampling: SamplingParams, ring: bool, **kw):
    """(tokens, text, telemetry) of one generation of N tokens on a fresh session of ``urls``."""
    session = RemoteRoute(urls, 60.0).open(len(ids) + N + 8, sampling, ring=ring)
    stats = GenerationStats()
    try:
        text = "".join(generate(session, tokenizer, ids, N, kw.get("stop"), stats, kw.get("drafter")))
        telemetry = session.telemetry
    finally:
        session.close()
    return stats.tokens, text, telemetry


@pytest.mark.parametrize("kind", ["greedy", "seeded", "grammar"])
def test_ring_decode_gives_the_tokens_of_client_driven_steps(cluster, gemma, kind):
    """Greedy, seeded sampling and grammar-constrained sampling (llama.cpp's grammar sampler at the head): the ring
    session's tokens are the client-driven session's, and the head sent nearly every decode step itself."""
    urls = [n.url for n in cluster]
    ids = gemma.prompt_ids(PROMPT if kind != "grammar" else 'Reply with a JSON object: {"ok": true}.', chat=True)
    json_object = response_format_grammar({"type": "json_object"})
    sampling = {
        "greedy": SamplingParams(temperature=0),
        "seeded": SamplingParams(temperature=0.9, seed=5),
        "grammar": SamplingParams(temperature=0.7, seed=3, penalize_from=len(ids), grammar=json_object),
    }[kind]
    want, want_text, plain = run(urls, gemma.tokenizer, ids, sampling, ring=False)
    got, text, ring = run(urls, gemma.tokenizer, ids, sampling, ring=True)
    assert got == want and text == want_text
    assert plain.ring_steps == 0
    # the reply link opens in the background after the first step: the ring carries the steps from then on
    assert ring.ring_steps > 0, (ring.ring_steps, len(got))  # how many: load-dependent (bench_ring), not asserted
    assert len(ring.steps) == len(plain.steps)  # every step's per-hop numbers arrived, the ring's included
    if kind == "grammar":  # (cut at N tokens: an object begun)
        assert text.lstrip().startswith("{")


def test_a_stop_string_ends_the_ring_and_the_session_goes_on_as_without_it(cluster, gemma):
    """A stop string mid-stream: the same text. The head had already sent the next step; the session rolls it back
    on every node (``ring_discarded``) when the caller does something else, and goes on with the tokens of a
    session that never had the ring."""
    urls = [n.url for n in cluster]
    ids = gemma.prompt_ids(PROMPT, chat=True)
    greedy = SamplingParams(temperature=0)
    _, full, _ = run(urls, gemma.tokenizer, ids, greedy, ring=False)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    outs = []
    for ring in (False, True):
        session = RemoteRoute(urls, 60.0).open(len(ids) + N + 8, greedy, ring=ring)
        try:
            text = "".join(generate(session, gemma.tokenizer, ids, N, [stop]))
            # neither is the sampled token: each time the head sent the next step, it is undone (the head sends it
            # when the client's grant reached it before the step did: two connections, so not every time on a loaded
            # machine)
            sent, more = 0, []
            for token in (7, 11):
                sent += session.session.decode_ring.pending is not None
                more.append(session.step([token]))
            outs.append((text, more, session.telemetry.ring_discarded, session.telemetry.ring_steps, sent))
        finally:
            session.close()
    (text0, more0, _, _, _), (text1, more1, discarded, steps, sent) = outs
    assert text1 == text0 and stop not in text1 and full.startswith(text1) and more1 == more0
    assert steps > 0 and discarded == sent, (discarded, sent)


def test_speculative_decoding_on_a_ring_session_sends_its_own_steps(cluster, gemma):
    """A drafter's verify steps on a session opened with the ring: the first verify turns the ring off (undoing the
    step the head had sent), and the tokens are plain greedy decoding's."""
    urls = [n.url for n in cluster]
    ids = gemma.prompt_ids("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", chat=False)
    greedy = SamplingParams(temperature=0)
    want, _, _ = run(urls, gemma.tokenizer, ids, greedy, ring=False)
    session = RemoteRoute(urls, 60.0).open(len(ids) + N + 8, greedy, ring=True)
    stats = GenerationStats()
    try:
        list(generate(session, gemma.tokenizer, ids, N, None, stats, NgramDrafter(4)))
        assert not session.session.decode_ring.on and stats.verify_steps > 0
    finally:
        session.close()
    assert stats.tokens == want


def test_cancelling_a_ring_generation_frees_every_node_within_2_s(cluster, gemma):
    """The task iterating a ring session's generation is cancelled mid-stream: within 2 s no node of the route
    holds the session (the close takes the head's grant back and waits for the last step it sent)."""
    urls = [n.url for n in cluster]
    ids = gemma.prompt_ids(PROMPT, chat=True)
    before = [health(u)["sessions"] for u in urls]

    async def main() -> tuple[int, float]:
        route = await RemoteRoute.connect(urls, 60.0)
        stats = GenerationStats()
        session = await route.aopen(len(ids) + 200, SamplingParams(temperature=0))

        async def generation():
            try:
                async for _ in agenerate(session, gemma.tokenizer, ids, 190, stats=stats):
                    pass
            finally:
                await session.close()

        task = asyncio.create_task(generation())
        while session.measured.ring_steps < 4:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return len(stats.tokens), t0

    n, t0 = asyncio.run(main())
    while [health(u)["sessions"] for u in urls] != before and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert [health(u)["sessions"] for u in urls] == before and time.monotonic() - t0 < 2.0
    assert n < 190


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model = str(write_tiny_model(tiny_dir / "ring-llama.gguf", "llama", n_layers=2))
    with tiny_split_route(model, tiny_dir / "ring") as route:
        yield route


def test_a_route_of_one_node_loops_on_itself(tiny):
    """One node holding every layer: the head sends each next step to itself; the tokens are the client-driven
    ones."""
    ids = [5 + (i * 11) % 300 for i in range(24)]
    outs = []
    for ring in (False, True):
        session = RemoteRoute([tiny["whole"]]).open(64, SamplingParams(temperature=0), ring=ring)
        try:
            out = [session.step(ids)]
            for _ in range(30):
                out.append(session.step([out[-1]]))
            outs.append((out, session.telemetry.ring_steps))
        finally:
            session.close()
    assert outs[1][0] == outs[0][0] and outs[0][1] == 0 and outs[1][1] > 0


def test_bad_grants_get_errors_and_the_head_keeps_serving(tiny):
    """Only the client that opened the session holds its reply link (the key it gave the head; another node of the
    route knows the session id, not the key: 401). The link's text messages are grants: anything else, binary
    messages, a ``first`` that is not a bare node URL, a loop (``first`` null) on a head that does not embed, or a
    step number out of range is answered with a 400 on the link (key NO_KEY) and changes nothing; a good grant makes
    the head send the next step (``"ring"`` in its reply) to the named first node."""
    first, head = tiny["first"], tiny["head"]
    ids = [5 + (i * 7) % 300 for i in range(8)]

    async def main():
        route = await RemoteRoute.connect([first, head])
        async with await route.aopen(64, SamplingParams(temperature=0), ring=False) as session:
            await session.step(ids)  # opens the session everywhere
            await session.step([9])  # the client opens its reply link now, in the background
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as http_:
                url = f"{head.replace('http', 'ws')}/v1/link?replies={session.id}"
                for key in ("", "&key=" + "0" * 32):  # another node of the route knows the id, not the key
                    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                        await http_.ws_connect(url + key)
                    assert refused.value.status == 401
                ws = await http_.ws_connect(f"{url}&key={session.reply_key}")  # (the client's: it replaces its own)
                await ws.send_bytes(b"\x01" * 40)
                key, status, body = decode_reply(await ws.receive_bytes(timeout=10))
                assert key == NO_KEY and status == 400 and "text messages" in json.loads(body)["error"]["message"]
                for bad in (
                    json.dumps({"ring": {"until": 3, "first": None}}),  # a loop on a head that does not embed
                    "hello",
                    json.dumps({"ring": {"until": -1, "first": first}}),
                    json.dumps({"ring": {"until": 3, "first": "http://127.0.0.1:1/v1/step?x=1"}}),
                    json.dumps({"ring": {"until": 3, "first": 5}}),
                    json.dumps({"ring": {"until": 3, "first": first, "quiet": "yes"}}),
                    "x" * 10000,
                ):
                    await ws.send_str(bad)
                    key, status, body = decode_reply(await ws.receive_bytes(timeout=10))
                    assert key == NO_KEY and status == 400 and json.loads(body)["error"]["code"] == "bad_request"
                # a good grant: the client's next step (3) makes the head send step 4 itself
                await ws.send_str(json.dumps({"ring": {"until": 4, "first": first}}))
                await asyncio.sleep(0.2)
                token = await session.step([11])  # a ring=False session: it does not take step 4
                replies = []
                while len(replies) < 3:  # step 3's own reply, step 4's own reply, step 4's route reply
                    replies.append(decode_reply(await ws.receive_bytes(timeout=10)))
                await ws.close()
            frame4 = encode_tokens(session.id, 4, len(ids) + 2, [token])
            assert [r[1] for r in replies] == [200, 200, 200]
            assert json.loads(replies[0][2])["ring"] == 4 and {r[0] for r in replies[1:]} == {frame4[8:32]}
            assert len(json.loads(replies[2][2])["hops"]) == 2  # the route's reply to the step the head sent

    before = [health(u)["sessions"] for u in (first, head)]
    asyncio.run(main())
    assert [health(u)["sessions"] for u in (first, head)] == before  # closed: the ring's step kept nothing
    assert health(head)["status"] == "ok"


def test_a_head_that_cannot_reach_the_first_node_is_no_dead_node(tiny, monkeypatch):
    """The head's ring steps to the first node fail (it is on a network only the client reaches, say): the client
    sends each such step itself, nodes answer from their records, the ring goes off for the session, nothing is
    repaired and the tokens are the client-driven ones."""
    from ggufswarm.net.link import LinkPool
    from ggufswarm.protocol.errors import RouteError

    first, head = tiny["first"], tiny["head"]
    send = LinkPool.send

    async def unreachable(self, url, frame, timeout_s, quiet=False):
        if url == first:  # only the head's ring steps go to the first node
            raise RouteError("hop_failed", f"node {url} failed: no route to host", 502, url)
        return await send(self, url, frame, timeout_s, quiet)

    ids = [5 + (i * 13) % 300 for i in range(12)]
    outs = []
    for ring in (False, True):
        if ring:
            monkeypatch.setattr(LinkPool, "send", unreachable)
        session = RemoteRoute([first, head]).open(64, SamplingParams(temperature=0), ring=ring, replan=lambda *a: 1 / 0)
        try:
            out = [session.step(ids)]
            for _ in range(12):
                out.append(session.step([out[-1]]))
            outs.append((out, session.session.decode_ring.on, session.telemetry.repairs, session.telemetry.ring_steps))
        finally:
            session.close()
    (want, _, _, _), (got, still_on, repairs, steps) = outs
    assert got == want and not still_on and repairs == [] and steps == 0


def test_steps_after_a_route_change_are_numbered_past_every_step_granted_to_the_head(tiny):
    """A repair (a node replaced mid-stream) drops the session's links while the head may still be sending the step
    it was granted: the steps after it get numbers past that grant, so no reply of the head's step is taken for a
    new step's (the same frame key) and the nodes refuse that step as stale. Here the repair's own moves (drop the
    links, rewind every node to 0 and relink, replay the history) run on an unchanged route: the tokens after it are
    those of a session never repaired."""
    from ggufswarm.client import repair

    first, head = tiny["first"], tiny["head"]
    ids = [5 + (i * 17) % 300 for i in range(10)]

    async def main(repair_at: int | None) -> tuple[list[int], list[int]]:
        route = await RemoteRoute.connect([first, head])
        numbers = []
        async with await route.aopen(64, SamplingParams(temperature=0), ring=True) as session:
            out = [await session.step(ids)]
            for i in range(12):
                if i == repair_at:
                    granted = session.decode_ring.granted
                    assert granted > session.step_no  # the head may send the next step itself
                    await session.drop_links()
                    numbers.append(session.step_no - granted)
                    await repair.rewind(session, route.hops, {}, 0, relink=True)
                    history = list(session.tokens)
                    del session.tokens[:]
                    session.boundaries = {0}
                    assert await session.step(history) == out[-1]  # the replay samples the same token again
                out.append(await session.step([out[-1]]))
            assert (await session.telemetry()).ring_steps > 0
        return out, numbers

    plain, _ = asyncio.run(main(None))
    repaired, numbers = asyncio.run(main(6))
    assert repaired == plain and numbers and numbers[0] >= 0


def test_a_reply_that_is_not_the_routes_is_not_recorded_as_its_per_hop_numbers():
    """The head's own reply to a step (one hop's numbers) is never taken as the route's (one per node): recorded, it
    would stand for every hop of the step, and the summary would read numbers that are not there."""
    from ggufswarm.client.telemetry import RouteTelemetry

    hop = {"compute_ms": 1.0, "handle_ms": 1.5, "bytes_in": 20, "kv_tokens": 4}
    urls = ["http://a:1", "http://b:2"]
    measured = RouteTelemetry()
    measured.record({"token": 3, "hops": [hop]}, 5.0, 1, urls)
    assert measured.steps == []
    measured.record({"token": 3, "hops": [hop, dict(hop, compute_ms=2.0)]}, 5.0, 1, urls)
    assert [s.compute_ms for s in measured.steps] == [[1.0, 2.0]]


def test_closing_takes_the_grant_back_and_waits_for_the_last_step_the_head_sent(monkeypatch):
    """A stream aborted while its step was on the way (the caller never read that reply, which would have said
    whether the head sent the next step under its grant): the session's close takes the grant back (``until`` 0 with
    ``ack``), and waits for the head's reply to the last step it says it sent before the nodes release the session,
    which would otherwise answer it session_closed (a new user's trial saw those errors on every node after 3 of 5
    aborts). A head that sent nothing past the steps read is not waited for; one that does not answer is waited
    for at the most it was granted (bounded)."""
    import json
    import uuid
    from types import SimpleNamespace

    from ggufswarm.client import ring as ring_module
    from ggufswarm.client.ring import Ring
    from ggufswarm.protocol.link import step_key

    class Replies:
        connected = True

        def __init__(self, ring, sent):
            self.waiting, self.grants, self.ring, self.sent = {}, [], ring, sent

        def expect(self, key, waiter, own=False):
            self.waiting[key] = waiter

        def forget(self, key, waiter=None):
            self.waiting.pop(key, None)

        async def send_text(self, text):
            self.grants.append(json.loads(text)["ring"])
            if self.sent is not None:  # the head's answer, after the grant took effect
                answer = json.dumps({"ring": {"sent": self.sent}})
                asyncio.get_running_loop().call_soon(self.ring._answered, answer)
            return True

    async def main():
        hops = [SimpleNamespace(url="http://127.0.0.1:1"), SimpleNamespace(url="http://127.0.0.1:2")]
        session = SimpleNamespace(id=uuid.uuid4(), step_no=5, route=SimpleNamespace(hops=hops), commit=False)
        ring = Ring(session, on=True)
        ring.replies, ring.granted, ring.granted_max, ring.answered = Replies(ring, 6), 20, 20, 4  # step 5 abandoned
        closing = asyncio.create_task(ring.finish())
        for _ in range(5):
            await asyncio.sleep(0)  # (finish runs to its wait)
        assert ring.replies.grants == [{"until": 0, "first": hops[0].url, "quiet": True, "ack": True}]
        assert not closing.done() and set(ring.replies.waiting) == {step_key(session.id, 6)}
        ring.replies.waiting[step_key(session.id, 6)].set_result((200, b"{}", True))
        await asyncio.wait_for(closing, 1.0)
        assert ring.replies.waiting == {} and ring.granted == 0
        ring = Ring(session, on=True)
        ring.replies, ring.granted, ring.answered = Replies(ring, 5), 20, 5  # the head sent nothing past step 5
        await asyncio.wait_for(ring.finish(), 0.5)
        assert ring.replies.waiting == {} and len(ring.replies.grants) == 1
        monkeypatch.setattr(ring_module, "FINISH_WAIT_S", 0.05)
        ring = Ring(session, on=True)
        ring.replies, ring.granted, ring.granted_max, ring.answered = Replies(ring, None), 20, 21, 5  # no answer
        waits = []
        monkeypatch.setattr(Ring, "_wait_step", lambda self, step, done, timeout: _record(waits, step, done))
        await asyncio.wait_for(ring.finish(), 1.0)
        assert waits == [(21, 5)]

    async def _record(waits, step, done):
        waits.append((step, done))

    asyncio.run(main())


def test_a_step_resent_after_its_link_failed_takes_the_heads_reply_when_the_ring_ran_past_it(tiny, monkeypatch):
    """A client-sent step whose link fails after the frame went out: the step went through, the head sampled it and
    sent the next step under its grant, so the resend on a fresh connection reaches a first node that applied that
    step and answers stale_step. The head's reply to the resent step, on the reply link, is the answer: the tokens
    are those of a session without the ring, nothing is repaired (a clean-clone CI run failed on this race once)."""
    from ggufswarm.net.link import FrameLink
    from ggufswarm.protocol.link import step_key

    first, head = tiny["first"], tiny["head"]
    ids = [5 + (i * 19) % 300 for i in range(9)]
    send = FrameLink.send
    seen = {}

    async def main(ring: bool) -> list[int]:
        route = await RemoteRoute.connect([first, head])
        async with await route.aopen(64, SamplingParams(temperature=0), ring=ring) as session:

            async def flaky(link, frame, waiter, timeout=None):
                step = int.from_bytes(frame[24:32], "little") if len(frame) >= 32 else -1
                if link is not session._link or not ring:
                    return await send(link, frame, waiter, timeout)
                if "failed" not in seen and session.decode_ring.granted > step:
                    sent = await send(link, frame, waiter, timeout)
                    seen["failed"] = step
                    await link.close()  # the frame is written: the step goes on; its reply never comes here
                    return sent
                if seen.get("failed") == step:  # the resend: once the head's next step went past the first node
                    ring_step = step_key(session.id, step + 1)
                    for _ in range(500):
                        if ring_step in session.decode_ring._early:
                            seen["ran_past"] = True
                            break
                        await asyncio.sleep(0.01)
                return await send(link, frame, waiter, timeout)

            monkeypatch.setattr(FrameLink, "send", flaky)
            out = [await session.step(ids)]
            for _ in range(10):
                out.append(await session.step([out[-1]]))
            assert (await session.telemetry()).repairs == []
            monkeypatch.setattr(FrameLink, "send", send)
        return out

    assert asyncio.run(main(True)) == asyncio.run(main(False))
    assert seen.get("ran_past"), seen


def counted(urls: list[str], family_name: str, **labels) -> int:
    """The sum over the nodes ``urls`` of a counter's series with ``labels`` (their /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0
    for url in urls:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == family_name:
                for x in family.samples:
                    if x.name.endswith("_total") and all(x.labels.get(k) == v for k, v in labels.items()):
                        total += int(x.value)
    return total


def replies_sent(urls: list[str]) -> int:
    """Step replies the nodes ``urls`` have sent on their links so far (``ggufswarm_node_link_messages_sent``)."""
    return counted(urls, "ggufswarm_node_link_messages_sent", kind="reply")


def test_quiet_ring_steps_send_no_replies_back_and_their_numbers_come_at_the_end(tiny):
    """Ring steps go quietly (frame flag bit 4): no node answers one that went through, so a decode token costs one
    message per hop and one to the client. The client reads each node's numbers of them when it reads its telemetry:
    every step has its StepTiming, with every hop's KV length and bytes as a session without the ring records them
    (compute_ms measured, not copied); every 16th step goes with replies and is timed from outside. (Which steps the
    ring carries depends on the machine's load: only what holds for any split is asserted.)"""
    first, head = tiny["first"], tiny["head"]
    ids = [5 + (i * 23) % 300 for i in range(7)]
    n = 40

    async def main(ring: bool):
        route = await RemoteRoute.connect([first, head])
        async with await route.aopen(64, SamplingParams(temperature=0), ring=ring) as session:
            out = [await session.step(ids)]
            before = replies_sent([first, head])
            for _ in range(n):
                out.append(await session.step([out[-1]]))
            telemetry = await session.telemetry()
            # a node waits for the error of the last quiet step it sent on only (the next one settles it)
            assert all(health(u)["links"]["awaited"] <= 1 for u in (first, head))
            await asyncio.sleep(0.2)  # (the head-sent step after the last one)
            return out, telemetry, replies_sent([first, head]) - before

    plain, plain_tel, plain_replies = asyncio.run(main(False))
    got, tel, quiet_replies = asyncio.run(main(True))
    assert [health(u)["links"]["awaited"] for u in (first, head)] == [0, 0]  # (closing settles the last)
    assert got == plain
    assert [s.step for s in tel.steps] == [s.step for s in plain_tel.steps] == list(range(1, n + 2))
    for mine, theirs in zip(tel.steps, plain_tel.steps):
        assert (mine.kv_tokens, mine.bytes_in, mine.start) == (theirs.kv_tokens, theirs.bytes_in, theirs.start)
        assert len(mine.compute_ms) == 2 and min(mine.compute_ms) > 0
    quiet = [s for s in tel.steps if not s.outer_ms]
    assert quiet and all(not s.network_ms for s in quiet) and tel.ring_steps >= len(quiet)
    assert all(s.outer_ms for s in tel.steps if s.step % 16 == 0)  # client-sent, or a measured ring step
    # each hop answers every step without the ring; with it, only the steps that were not quiet (the head-sent step
    # after the last one may be either)
    assert plain_replies >= 2 * n and quiet_replies <= 2 * (n + 1 - len(quiet))


def test_the_head_runs_ahead_under_its_grant_and_a_caller_that_turns_back_undoes_every_step_it_sent(tiny, monkeypatch):
    """The client grants 16 steps ahead, again when half are used (one grant message per 8 tokens, not one per
    token). A caller that pauses lets the head run on to the end of its grant; when the caller then feeds another
    token, the client takes the grant back, the head says the last step it sent, the client waits for it and rolls
    every node back over all of them: the tokens are those of a session without the ring, no ring step failed, and
    the session goes on on the ring."""
    from ggufswarm.client import ring as ring_module
    from ggufswarm.net.link import FrameLink
    from ggufswarm.protocol.link import step_key

    first, head = tiny["first"], tiny["head"]
    ids = [5 + (i * 29) % 300 for i in range(6)]
    grants, send_text = [], FrameLink.send_text

    async def counted_text(self, text):
        grants.append(json.loads(text)["ring"])
        return await send_text(self, text)

    monkeypatch.setattr(FrameLink, "send_text", counted_text)
    revoked, revoke = [], ring_module.Ring.revoke

    async def recorded_revoke(self):
        revoked.append(await revoke(self))
        return revoked[-1]

    monkeypatch.setattr(ring_module.Ring, "revoke", recorded_revoke)
    failed_before = counted([first, head], "ggufswarm_node_ring_steps", result="failed")

    async def main(ring: bool, n_before: int = 25):
        route = await RemoteRoute.connect([first, head])
        async with await route.aopen(96, SamplingParams(temperature=0), ring=ring) as session:
            out = [await session.step(ids)]
            deadline = time.monotonic() + 10
            while len(out) < n_before or (ring and session.decode_ring.pending is None and time.monotonic() < deadline):
                out.append(await session.step([out[-1]]))  # (the reply link opens in the background)
            ahead = 0
            if ring:  # the head runs on past the step the caller has not taken (its reply to step n + 2 comes)
                beyond = step_key(session.id, session.step_no + 2)
                while beyond not in session.decode_ring._early and time.monotonic() < deadline + 20:
                    await asyncio.sleep(0.02)
                ahead = session.decode_ring.granted - session.step_no
            n = len(out)
            out.append(await session.step([7]))  # not the sampled token: every step the head sent is undone
            for _ in range(8):
                out.append(await session.step([out[-1]]))
            telemetry = await session.telemetry()
        return out, n, ahead, telemetry

    got, n, ahead, telemetry = asyncio.run(main(True))
    plain, _, _, _ = asyncio.run(main(False, n))
    assert got == plain
    assert ahead > 1 and telemetry.ring_discarded == 1 and telemetry.ring_steps > 0
    assert revoked[0] > n + 1  # the head had sent steps past the one the caller did not take (step n + 1)
    assert counted([first, head], "ggufswarm_node_ring_steps", result="failed") == failed_before
    renewals = [g for g in grants if g["until"]]
    assert len(renewals) <= len(got) // (ring_module.GRANT_AHEAD // 2) + 3  # (+ the renewal after the revoke)
    assert [g for g in grants if not g["until"]] == [g for g in grants if g.get("ack")] and len(grants) > len(renewals)


def test_a_quiet_step_that_fails_downstream_reaches_the_client_and_is_sent_again(tiny, monkeypatch):
    """A quiet ring step that fails on the head (an internal error, once): the head answers it with the error, the
    first node passes it back to the head's ring link, the head to the client on the reply link; the client sends the
    same frame itself, with replies, the first node relays the output it recorded, and the tokens are those of a
    session without the ring; nothing is repaired."""
    from ggufswarm.node import steps
    from ggufswarm.protocol import ProtocolError

    first, head = tiny["first"], tiny["head"]
    ids = [5 + (i * 29) % 300 for i in range(6)]
    apply = steps._apply
    failed = []

    def flaky(path, session, frame, digest):
        if path.spec.head and frame.quiet and not failed:
            failed.append(frame.step)
            raise ProtocolError("internal", "a test's failure, once")
        return apply(path, session, frame, digest)

    async def main(ring: bool):
        route = await RemoteRoute.connect([first, head])
        async with await route.aopen(64, SamplingParams(temperature=0), ring=ring, replan=lambda *a: 1 / 0) as s:
            out = [await s.step(ids)]
            for _ in range(30):
                out.append(await s.step([out[-1]]))
            return out, (await s.telemetry())

    plain, _ = asyncio.run(main(False))
    monkeypatch.setattr(steps, "_apply", flaky)
    ring_failed = counted([head], "ggufswarm_node_ring_steps", result="failed")
    got, tel = asyncio.run(main(True))
    assert got == plain and failed and tel.repairs == []
    # the error came back to the head (not the client's timeout)
    assert counted([head], "ggufswarm_node_ring_steps", result="failed") == ring_failed + 1
    assert failed[0] in {s.step for s in tel.steps if len(s.outer_ms) == 2}  # sent again with replies


def test_closing_after_a_stream_aborted_during_its_prefill_leaves_no_error_on_the_nodes(tiny):
    """A caller that gives up on a client-sent step (a stream closed before its first token: the prefill is on the
    nodes): the session's close waits for that step before the nodes release the session, which would otherwise
    answer it session_closed on every node (a new user's trial: errors on the nodes after each such close)."""
    first, head = tiny["first"], tiny["head"]
    prompt = [5 + (i * 31) % 300 for i in range(300)]

    async def abort(delay: float) -> bool:
        route = await RemoteRoute.connect([first, head])
        session = await route.aopen(400, SamplingParams(temperature=0), ring=True)
        step = asyncio.create_task(session.step(prompt))
        await asyncio.sleep(delay)
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step
        abandoned = session.decode_ring.abandoned is not None  # cancelled while the step was on the nodes
        await session.close()
        return abandoned

    before = counted([first, head], "ggufswarm_node_errors")
    aborted = [asyncio.run(abort(delay)) for delay in (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016)]
    time.sleep(0.5)
    assert any(aborted)  # (a delay that fell inside the prefill)
    assert counted([first, head], "ggufswarm_node_errors") == before
    assert [health(u)["sessions"] for u in (first, head)] == [0, 0]


def test_a_request_cut_off_before_its_body_arrived_is_client_gone_not_a_failure(tiny):
    """A client that closes its connection in the middle of a request body (an aborted request) gets client_gone
    (499) counted, not an internal error with a traceback; the node goes on serving."""
    import socket
    from urllib.parse import urlsplit

    first = tiny["first"]
    before = counted([first], "ggufswarm_node_errors", code="client_gone")
    internal = counted([first], "ggufswarm_node_errors", code="internal")
    url = urlsplit(first)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(
            b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
            b'{"session_id": '
        )
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while counted([first], "ggufswarm_node_errors", code="client_gone") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted([first], "ggufswarm_node_errors", code="client_gone") == before + 1
    assert counted([first], "ggufswarm_node_errors", code="internal") == internal
    assert health(first)["status"] == "ok"
