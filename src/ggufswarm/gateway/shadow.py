"""Shadow replay: run an audited session's steps again on a route where one hop is served by another node, and
compare what each node committed to (docs/protocol.md, "Verification by shadow replay").

A llama.cpp shard's output is a deterministic function of its input on one build and CPU kind (nodes advertise that
as ``extra.numerics.id``), and a shard boundary's hidden state does not depend on how earlier layers were split. So
two nodes of the same numerics id serving the same layers, fed the same steps grouped the same way, commit to the
same output hashes; the first hop whose output hash differs is where the two runs part. Every commitment compared is
checked against its node's signature (``net.identity``), so what a node said cannot be denied or forged afterwards.

``Recording`` is what the gateway keeps of an audited session, ``replay`` runs it on a shadow route, ``compare``
judges one hop of the two runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from ..client.route import Hop, RemoteRoute
from ..net.commitments import evidence_form, verify_commit
from ..net.identity import IdentityError
from ..runtime.sampling import SamplingParams


class Unverifiable(Exception):
    """An audit that cannot conclude (no node to compare with, a replay that failed, a commitment missing): never
    held against the audited node. The message says why."""


@dataclass(frozen=True)
class SentFrame:
    """One step frame as the client sent it: its ``step`` number, ``start`` position, token ``ids``, and whether the
    head was to sample (``sample``) or sample after every position (``verify``, speculative decoding)."""

    step: int
    start: int
    ids: tuple[int, ...]
    sample: bool
    verify: bool


@dataclass
class Recording:
    """What an audited route session did, enough to run it again: its id ``sid``, the route ``hops`` its frames went
    through, the ``frames`` in order with each one's per-hop ``commits`` (``{"in", "out", "key", "sig"}`` or None),
    the ``prefix`` of tokens its nodes held before the first frame (restored from snapshots) with the step ends
    ``prefix_bounds`` inside it, the session's settings (the head's sampler included: a replayed head draws the
    same tokens) and each hop's commitment ``contexts`` (what its node said its commitments sign, at open)."""

    sid: str
    hops: list[Hop]
    frames: list[SentFrame]
    commits: list[list[dict | None]]
    prefix: list[int]
    prefix_bounds: list[int]
    sampling: SamplingParams
    max_length: int
    wire_dtype: str
    top_logprobs: int
    logprobs: bool
    contexts: list[dict | None] = field(default_factory=list)  # per hop: the context its commitments sign

    @classmethod
    def of(cls, session, hops: list[Hop]) -> Recording | None:
        """The recording of ``session`` (an AsyncRouteSession opened with ``commit`` whose ``sent`` frames were kept)
        on route ``hops`` (its route when it opened): its frames up to the first one without a reply along the route
        or sent on another route (after a repair); None when there is none."""
        urls = [h.url for h in hops]
        timings = {t.step: t for t in session.measured.steps if t.step}
        frames, commits = [], []
        for step, start, ids, sample, verify_ in session.sent or ():
            timing = timings.get(step)
            if timing is None or timing.urls != urls or len(timing.commits) != len(hops):
                break
            frames.append(SentFrame(step, start, tuple(ids), sample, verify_))
            commits.append(list(timing.commits))
        if not frames:
            return None
        held = frames[0].start
        bounds = sorted({b for b in session.boundaries if 0 < b < held} | ({held} if held else set()))
        return cls(
            str(session.id),
            list(hops),
            frames,
            commits,
            list(session.tokens[:held]),
            bounds,
            session.sampling,
            session.max_length,
            session.wire_dtype,
            session.top_logprobs,
            session.logprobs,
            [session.contexts.get(h.url) for h in hops],
        )


@dataclass
class Replayed:
    """A shadow run of a Recording: its session id ``sid``, its step number for each recorded frame, and each
    frame's per-hop commitments (None for a frame whose reply along the route did not come back)."""

    sid: str
    steps: list[int]
    commits: list[list[dict | None] | None]


def shadow_route(rec: Recording, i: int, hop: Hop, hop_timeout_s: float, model: str | None, token: str | None):
    """The recording's route with hop ``i`` served by ``hop`` (a RemoteRoute). Unverifiable when ``hop`` serves other
    layers or stages, or would group the recorded steps otherwise (smaller ``max_step_tokens`` / verify limit)."""
    old = rec.hops[i]
    if (hop.start, hop.end, hop.embed, hop.head) != (old.start, old.end, old.embed, old.head):
        raise Unverifiable(f"{hop.url} serves {hop.start}:{hop.end}, not {old.start}:{old.end}")
    route = RemoteRoute.of_hops(rec.hops[:i] + [hop] + rec.hops[i + 1 :], hop_timeout_s, model=model, token=token)
    biggest = max(len(f.ids) for f in rec.frames)
    if biggest > route.max_step_tokens:
        raise Unverifiable(f"{hop.url} takes steps of {route.max_step_tokens} tokens, the session sent {biggest}")
    return route


async def replay(rec: Recording, route: RemoteRoute, http: aiohttp.ClientSession, lease_s: float | None) -> Replayed:
    """Run ``rec``'s steps on ``route`` as a new session opened with commitments, teacher-forced (the recorded token
    ids, whatever the head samples), each frame grouped as recorded (the restored prefix first, in its own steps, by
    ``prefix_bounds``); a recorded rewind (speculative drafts dropped) is replayed as one. No route repair: a node
    that fails makes the replay fail. Raises RouteError, or Unverifiable for frames that do not follow each other."""
    session = await route.aopen(
        rec.max_length,
        rec.sampling,
        rec.wire_dtype,
        rec.top_logprobs,
        None,  # no repair: a replay on another route than planned compares nothing
        False,  # no prefix restore: the recorded prefix is computed in its recorded steps
        lease_s,
        rec.logprobs,
        http=http,
        commit=True,
        ring=False,  # teacher-forced: every step is the recording's, sent as recorded
    )
    session.measured.keep_commits = True
    steps: list[int] = []
    try:
        done = 0
        for end in rec.prefix_bounds:
            await session.step(rec.prefix[done:end], sample=False)
            done = end
        for frame in rec.frames:
            if frame.start < session.position:
                session.drop(session.position - frame.start)
            if frame.start != session.position:
                raise Unverifiable(f"step {frame.step} starts at {frame.start}, the replay holds {session.position}")
            if frame.verify:
                if len(frame.ids) > session.max_verify_tokens:
                    raise Unverifiable(f"the shadow head verifies {session.max_verify_tokens} tokens a step")
                await session.verify(list(frame.ids))
            else:
                await session.step(list(frame.ids), frame.sample)
            steps.append(session.step_no)
        measured = await session.telemetry()
    finally:
        await session.close()
    timings = {t.step: t for t in measured.steps if t.step}
    return Replayed(str(session.id), steps, [timings[s].commits if s in timings else None for s in steps])


def checked(commit, sid: str, step: int, start: int, n: int, key: str | None) -> dict:
    """``commit`` in evidence form (net.commitments.evidence_form: what it signed, ``sid``, ``step``, ``start``,
    ``n`` included, and its ``sig``). Unverifiable when it is missing, names another key than ``key`` (when given),
    or its signature does not verify (ed25519, RFC 8032)."""
    if not isinstance(commit, dict):
        raise Unverifiable(f"no commitment for step {step}")
    if key is not None and commit.get("key") != key:
        raise Unverifiable(f"the commitment of step {step} names key {str(commit.get('key'))[:16]}…, not {key[:16]}…")
    try:
        verify_commit(commit, sid, step, start, n)
    except (IdentityError, TypeError, ValueError) as exc:
        raise Unverifiable(f"the commitment of step {step} does not verify ({exc}): altered on its way back") from None
    return evidence_form(commit, sid, step, start, n)


def check_recording(rec: Recording, i: int, key: str) -> None:
    """Check, before any replay, that the recording's commitments of hops ``0..i`` are all there, verify, and that
    hop ``i``'s name ``key``; Unverifiable otherwise (no replay could then be compared). CPU-bound, as ``compare``."""
    for frame, commits in zip(rec.frames, rec.commits):
        for j in range(i + 1):
            checked(commits[j], rec.sid, frame.step, frame.start, len(frame.ids), key if j == i else None)


@dataclass
class Verdict:
    """One hop compared between the real run and a replay: ``result`` ``match`` (every step compared agreed) or
    ``mismatch``; ``compared`` steps; at a mismatch, ``frame`` (its index) and ``real`` / ``other`` (the two signed
    commitments of the hop for that step, in evidence form)."""

    result: str
    compared: int
    frame: int | None = None
    real: dict | None = None
    other: dict | None = None


def compare(rec: Recording, run: Replayed, i: int, key: str | None, other_key: str | None) -> Verdict:
    """Compare hop ``i`` of ``rec`` (node key ``key``) with the same hop of ``run`` (node key ``other_key``), step by
    step, from the commitments of hops ``0..i`` (the hops before ``i`` are the same nodes in both runs: their outputs
    must agree for ``i``'s inputs to be the same). The first step where hop ``i``'s output hashes differ with equal
    input hashes is a mismatch; a replay whose commitments stop early is compared as far as they go.

    Raises Unverifiable when no step could be compared, when a commitment compared is missing or does not verify, or
    when an earlier hop (the same node in both runs) or the inputs disagree: the audit cannot tell who is at fault.
    CPU-bound (an ed25519 check per commitment, ~0.13 ms): run it off the event loop."""
    compared = 0
    for k, frame in enumerate(rec.frames):
        mine, theirs = rec.commits[k], run.commits[k]
        if theirs is None:
            break
        n = len(frame.ids)
        for j in range(i + 1):
            want = (key, other_key) if j == i else (None, None)
            real = checked(mine[j], rec.sid, frame.step, frame.start, n, want[0])
            other = checked(theirs[j], run.sid, run.steps[k], frame.start, n, want[1])
            if j < i and real["key"] != other["key"]:
                raise Unverifiable(f"hop {j} is another node in the replay")
            if real["in"] != other["in"]:
                raise Unverifiable(f"hop {j} got other inputs in the replay at step {frame.step}")
            if real["out"] != other["out"]:
                if j < i:
                    raise Unverifiable(
                        f"hop {j} (not audited, the same node in both runs) answered step {frame.step} otherwise"
                    )
                return Verdict("mismatch", compared + 1, k, real, other)
        compared += 1
    if not compared:
        raise Unverifiable("the replay brought back no commitment to compare")
    return Verdict("match", compared)


__all__ = [
    "Recording",
    "Replayed",
    "SentFrame",
    "Unverifiable",
    "Verdict",
    "check_recording",
    "checked",
    "compare",
    "replay",
    "shadow_route",
]
