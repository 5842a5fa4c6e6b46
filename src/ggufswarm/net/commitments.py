"""Step commitments and the ban proof built from them (docs/protocol.md, "Step commitments", "Bans by proof").

A node serving a session opened with ``commit`` signs, per step, digests of its input and output, the session's
context (``commit_context``) and the chain of everything its KV cache was computed from (``chain_next``). Two
honest nodes that sign the same context, history and input sign the same output, so a ban is checkable by anyone,
trusting no one (``check_ban_evidence``): the accused's own commitment against those of at least two other nodes
of its numerics and range."""

from __future__ import annotations

import bisect
import json
import uuid
from collections.abc import Callable

from ..protocol.frame import FLAG_NO_SAMPLE, FLAG_VERIFY
from ..runtime.digest import digest
from .identity import IdentityError, canonical, public_key, verify

COMMIT_FIELDS = ("in", "out", "key", "sig", "ctx", "prev")  # string fields of a hop record's ``commit``
MODE_FLAGS = FLAG_NO_SAMPLE | FLAG_VERIFY  # the frame flags a commitment signs (they decide a head's output)
EVIDENCE_KIND = "step-mismatch"
MIN_WITNESSES = 2
MAX_WITNESSES = 8
MAX_EVIDENCE_BYTES = 64 * 1024  # a ban's evidence, as canonical JSON: a few signed commitments and a context
MAX_CONTEXT_BYTES = 8 * 1024


class BadEvidence(ValueError):
    """A ban whose evidence does not prove what it says; the message names what is missing or wrong."""


class UnknownWitness(BadEvidence):
    """Evidence that holds, but one of its witnesses is not known to the checker as a node of the accused's layers
    and numerics (it may be, later: a checker that lists more nodes may judge it again)."""


def commit_context(
    model: str, start: int, end: int, embed: bool, head: bool, numerics: str, wire_dtype: str, sampling: dict | None
) -> dict:
    """A session's commitment context on one node (what ``ctx`` digests): ``{"model": GGUF fingerprint, "layers":
    [start, end], "embed", "head", "numerics": numerics id, "wire": wire dtype}`` and, on the head only,
    ``"sampling"`` (the session's SamplingParams as a dict): everything besides the inputs that decides the bits
    the node signs."""
    ctx = {
        "model": model,
        "layers": [start, end],
        "embed": bool(embed),
        "head": bool(head),
        "numerics": numerics,
        "wire": wire_dtype,
    }
    if head:
        ctx["sampling"] = sampling or {}
    return json.loads(json.dumps(ctx))  # as it travels (a logit_bias's int keys become strings): digested so


def served_context(extra: dict, layers, embed: bool, head: bool) -> dict:
    """What a node advertises it serves, in a commitment context's terms: ``{"model", "layers", "embed", "head",
    "numerics"}`` from its advertisement's ``extra`` (``hop.model_fingerprint``, ``numerics.id``) and range."""
    hop = extra.get("hop") if isinstance(extra, dict) and isinstance(extra.get("hop"), dict) else {}
    numerics = extra.get("numerics") if isinstance(extra, dict) and isinstance(extra.get("numerics"), dict) else {}
    return {
        "model": hop.get("model_fingerprint"),
        "layers": [int(layers[0]), int(layers[1])],
        "embed": bool(embed),
        "head": bool(head),
        "numerics": numerics.get("id"),
    }


def serves_context(served: dict, context: dict) -> str | None:
    """None when ``served`` (``served_context``) is what ``context`` says its node computes; else the difference."""
    want = {k: context.get(k) for k in ("model", "layers", "embed", "head", "numerics")}
    if served != want:
        return f"it advertises serving {served}, not the context's {want}"
    return None


def context_digest(ctx: dict) -> str:
    """``ctx`` of a commitment: SHA-256/128 of the context's canonical JSON."""
    return digest(canonical(ctx))


def chain_next(prev: str, start: int, n: int, mode: int, in_digest: str) -> str:
    """The history digest after a step (``prev`` of the session's next step at position ``start + n``)."""
    return digest(canonical({"prev": prev, "start": start, "n": n, "mode": mode, "in": in_digest}))


def history_at(chain: list[tuple[int, str]], position: int) -> str:
    """The history digest of a session's KV cache cut back to ``position`` tokens, from ``chain`` (``(KV position
    where a step ended, history digest there)``, ascending): the one recorded there; inside a step (a rollback into
    it: speculative drafts dropped, a truncation), the digest of that step's end and the cut; ``""`` past what the
    chain covers. O(1) for the chain's end (a decode step), O(log n) otherwise."""
    if chain and chain[-1][0] == position:
        return chain[-1][1]
    i = bisect.bisect_left(chain, position, key=lambda entry: entry[0])
    if i == len(chain):
        return ""
    at, history = chain[i]
    return history if at == position else digest(canonical({"prev": history, "cut": position}))


def signed_body(session_id: uuid.UUID | str, step: int, start: int, n_tokens: int, commit: dict) -> dict:
    """The object a commitment's ``sig`` signs (before ``canonical``): the step's ``sid`` (string), ``step``,
    ``start``, ``n`` and the commitment's ``mode``, ``in``, ``out``, ``key``, ``ctx`` and ``prev``."""
    return {
        "sid": str(session_id),
        "step": step,
        "start": start,
        "n": n_tokens,
        "mode": commit.get("mode"),
        "in": commit.get("in"),
        "out": commit.get("out"),
        "key": commit.get("key"),
        "ctx": commit.get("ctx"),
        "prev": commit.get("prev"),
    }


def verify_commit(
    commit: dict, session_id: uuid.UUID | str, step: int, start: int, n_tokens: int, key_id: str | None = None
) -> None:
    """Check that ``commit`` (a hop record's ``commit``) is a valid signature of its digests for this step by
    ``key_id`` (when given: the key the client expects on that hop; else the commitment's own ``key``).
    IdentityError when a field is missing, the key is not ``key_id``, or the signature does not verify (ed25519,
    RFC 8032)."""
    if (
        not isinstance(commit, dict)
        or any(not isinstance(commit.get(f), str) for f in COMMIT_FIELDS)
        or not isinstance(commit.get("mode"), int)
    ):
        raise IdentityError(
            f"a step commitment has string fields {', '.join(COMMIT_FIELDS)} and an integer mode, "
            f"got {str(commit)[:200]}"
        )
    if key_id is not None and commit["key"] != key_id:
        raise IdentityError(f"step {step} is committed by key {commit['key'][:16]}…, expected {key_id[:16]}…")
    verify(commit["key"], canonical(signed_body(session_id, step, start, n_tokens, commit)), commit["sig"])


def evidence_form(commit: dict, session_id: uuid.UUID | str, step: int, start: int, n_tokens: int) -> dict:
    """A commitment as a ban's evidence carries it: what it signed (``signed_body``) and its ``sig``."""
    return {**signed_body(session_id, step, start, n_tokens, commit), "sig": commit.get("sig")}


def _checked(item, what: str) -> dict:
    """An evidence-form commitment whose signature verifies; BadEvidence naming ``what`` otherwise."""
    if not isinstance(item, dict):
        raise BadEvidence(f"{what}: a signed step commitment (an object) is missing")
    try:
        verify_commit(item, item.get("sid"), item.get("step"), item.get("start"), item.get("n"))
        public_key(item["key"])
    except (IdentityError, TypeError, ValueError) as exc:
        raise BadEvidence(f"{what}: the signed step commitment does not verify ({exc})") from None
    return item


def check_ban_evidence(key: str, evidence, witness: Callable[[str, dict], str | None]) -> dict:
    """Check that ``evidence`` proves node ``key`` lied, trusting nothing in it that is not signed; the accused's
    checked commitment. Raises BadEvidence naming what is missing or wrong.

    ``evidence``: ``{"kind": "step-mismatch", "context": {...}, "accused": C, "witnesses": [C, C, ...]}`` with each C
    a commitment in evidence form (``evidence_form``). It proves when: it is at most MAX_EVIDENCE_BYTES; the context's
    digest is the ``ctx`` every commitment signed; ``accused`` is signed by ``key``; at least MIN_WITNESSES (at most
    MAX_WITNESSES) witnesses, each signed by another key, none the accused's; every witness signed the accused's
    ``prev``, ``start``, ``n``, ``mode`` and ``in`` (the same input after the same history, ``prev`` not empty); the
    witnesses' ``out`` are all equal and differ from the accused's. ``witness(key, context)`` is the checker's own
    knowledge: None when it knows ``key`` as a node serving that context's model, layers and numerics, else why not
    (a key that signs is free to make; a node of the swarm is not)."""
    if not isinstance(evidence, dict):
        raise BadEvidence("evidence must be a JSON object: the signed step commitments that prove the key lied")
    if len(canonical(evidence)) > MAX_EVIDENCE_BYTES:
        raise BadEvidence(f"evidence is over {MAX_EVIDENCE_BYTES} bytes")
    if evidence.get("kind") != EVIDENCE_KIND:
        raise BadEvidence(
            f"evidence kind must be {EVIDENCE_KIND!r} (signed step commitments), got {evidence.get('kind')!r}"
        )
    context = evidence.get("context")
    if not isinstance(context, dict) or len(json.dumps(context)) > MAX_CONTEXT_BYTES:
        raise BadEvidence("evidence.context (the commitments' context: model, layers, numerics, ...) is missing")
    for field in ("model", "numerics"):
        if not isinstance(context.get(field), str) or not context[field]:
            raise BadEvidence(f"evidence.context names no {field}: the bits its nodes sign are not determined")
    ctx = context_digest(context)
    accused = _checked(evidence.get("accused"), "evidence.accused")
    if accused["key"] != key:
        raise BadEvidence(f"evidence.accused is signed by {accused['key'][:16]}…, not by the key banned")
    witnesses = evidence.get("witnesses")
    if not isinstance(witnesses, list) or not MIN_WITNESSES <= len(witnesses) <= MAX_WITNESSES:
        raise BadEvidence(
            f"evidence.witnesses: {MIN_WITNESSES} to {MAX_WITNESSES} signed commitments of other nodes are needed"
        )
    checked = [_checked(w, f"evidence.witnesses[{i}]") for i, w in enumerate(witnesses)]
    keys = {w["key"] for w in checked}
    if len(keys) < len(checked) or key in keys:
        raise BadEvidence("evidence.witnesses must be signed by distinct keys, none of them the accused's")
    for who, c in [("accused", accused)] + [(f"witnesses[{i}]", w) for i, w in enumerate(checked)]:
        if c["ctx"] != ctx:
            raise BadEvidence(f"evidence.{who} was signed for another context than evidence.context")
    if not accused["prev"]:
        raise BadEvidence("evidence.accused signs no history (prev is empty): its input cannot be reproduced")
    for i, w in enumerate(checked):
        for field in ("prev", "start", "n", "mode", "in"):
            if w[field] != accused[field]:
                raise BadEvidence(f"evidence.witnesses[{i}] signed another {field} than the accused: not the same step")
    outs = {w["out"] for w in checked}
    if len(outs) != 1:
        raise BadEvidence("the witnesses disagree with each other: nothing is proven")
    if accused["out"] in outs:
        raise BadEvidence("the witnesses agree with the accused: nothing is proven")
    for i, w in enumerate(checked):
        why = witness(w["key"], context)
        if why is not None:
            raise UnknownWitness(f"evidence.witnesses[{i}] (key {w['key'][:16]}…): {why}")
    return accused


__all__ = [
    "COMMIT_FIELDS",
    "EVIDENCE_KIND",
    "MAX_EVIDENCE_BYTES",
    "MIN_WITNESSES",
    "MODE_FLAGS",
    "BadEvidence",
    "UnknownWitness",
    "chain_next",
    "check_ban_evidence",
    "commit_context",
    "context_digest",
    "evidence_form",
    "history_at",
    "served_context",
    "serves_context",
    "signed_body",
    "verify_commit",
]
