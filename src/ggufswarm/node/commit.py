"""Step commitments (docs/protocol.md, "Step commitments"): for a session opened with ``"commit": true``, each node
signs, per step, digests of what it took in and what it gave out, so that a client can check a node's work later
(replaying the step on a node it trusts) and prove what that node claimed.

A hop record's ``commit`` is ``{"in": IN, "out": OUT, "key": KEY, "sig": SIG}``: IN and OUT are SHA-256/128 hex
digests (runtime/digest.py) — IN of the step frame's payload as received (token ids, or hidden states in the
session's wire dtype; the bytes after the 48-byte header, without the token-id trailer), OUT of the payload of the
frame pushed to the next hop (so ``out`` of hop k is ``in`` of hop k + 1 on an honest route), or on the head of the
float32 logits rows it computed followed by the int32 tokens it drew; KEY is the node's key id; SIG its ed25519
signature of ``canonical({"sid", "step", "start", "n", "in", "out", "key"})`` (net/identity.py).

Cost (2-core AMD EPYC, Gemma 3 270M, f32 frames): a non-head node hashes two rows of 2560 bytes (~5 µs) and signs
(~40 µs), after its frame is already on its way to the next hop; the head hashes 1 MiB of logits per drawn row
(~0.6 ms) and signs before it answers. A session without ``commit`` runs none of it.
"""

from __future__ import annotations

import uuid

from ..net.identity import IdentityError, NodeIdentity, canonical, verify
from ..protocol.frame import HEADER_SIZE, ITEMSIZE, Frame
from ..runtime.digest import digest

COMMIT_FIELDS = ("in", "out", "key", "sig")


def payload(body: bytes, n_tokens: int, n_embd: int, dtype: str) -> memoryview:
    """The payload of frame ``body`` holding ``n_tokens`` rows of ``n_embd`` values in wire ``dtype`` (or ``n_tokens``
    ids, dtype ``ids``): the values exactly as they travel, without header or token-id trailer — a view, not a
    copy."""
    width = 1 if dtype == "ids" else n_embd
    return memoryview(body)[HEADER_SIZE : HEADER_SIZE + n_tokens * width * ITEMSIZE[dtype]]


def signed_body(session_id: uuid.UUID | str, step: int, start: int, n_tokens: int, commit: dict) -> dict:
    """The object a commitment's ``sig`` signs (before ``canonical``): ``{"sid": session id string, "step", "start",
    "n": n_tokens, "in", "out", "key"}`` (``in``, ``out``, ``key`` from ``commit``)."""
    return {
        "sid": str(session_id),
        "step": step,
        "start": start,
        "n": n_tokens,
        "in": commit["in"],
        "out": commit["out"],
        "key": commit["key"],
    }


def step_commit(identity: NodeIdentity, frame: Frame, in_digest: str, out_digest: str) -> dict:
    """This node's signed commitment to step ``frame`` (its session, step, start, n_tokens): ``{"in", "out", "key",
    "sig"}`` with the given IN and OUT digests (32 hex characters each)."""
    commit = {"in": in_digest, "out": out_digest, "key": identity.key_id}
    body = signed_body(frame.session_id, frame.step, frame.start, frame.n_tokens, commit)
    return {**commit, "sig": identity.sign(canonical(body))}


def input_digest(body: bytes, frame: Frame) -> str:
    """IN of a step commitment: the digest of the payload of ``body`` (the frame decoded as ``frame``), hashed in
    place."""
    return digest(payload(body, frame.n_tokens, frame.n_embd, frame.dtype))


def output_digest(out: bytes, frame: Frame, n_embd: int, dtype: str) -> str:
    """OUT of a non-head node's step commitment: the digest of the payload of ``out``, the frame it pushed for step
    ``frame`` (``frame.n_tokens`` rows of ``n_embd`` values in wire ``dtype``)."""
    return digest(payload(out, frame.n_tokens, n_embd, dtype))


def verify_commit(
    commit: dict, session_id: uuid.UUID | str, step: int, start: int, n_tokens: int, key_id: str | None = None
) -> None:
    """Check that ``commit`` (a hop record's ``commit``) is a valid signature of its digests for this step by
    ``key_id`` (when given: the key the client expects on that hop; else the commitment's own ``key``).
    IdentityError when a field is missing, the key is not ``key_id``, or the signature does not verify."""
    if not isinstance(commit, dict) or any(not isinstance(commit.get(f), str) for f in COMMIT_FIELDS):
        raise IdentityError(f"a step commitment has string fields {', '.join(COMMIT_FIELDS)}, got {str(commit)[:200]}")
    if key_id is not None and commit["key"] != key_id:
        raise IdentityError(f"step {step} is committed by key {commit['key'][:16]}…, expected {key_id[:16]}…")
    verify(commit["key"], canonical(signed_body(session_id, step, start, n_tokens, commit)), commit["sig"])


__all__ = ["COMMIT_FIELDS", "input_digest", "output_digest", "payload", "signed_body", "step_commit", "verify_commit"]
