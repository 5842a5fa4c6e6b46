"""One route session's state on a node: its KV cache, the step records it answers retries from, the step
boundaries its history was computed with (``Session``), and the errors the session store raises."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from .kv import KVPosition
from .sampling import SamplerBase


class SessionError(Exception):
    """Base of the store's errors; ``code`` is the protocol's machine-readable error code."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code or self.code


class Recent(dict):
    """The last ``size`` keys added (``add``) with their values, oldest first: sessions a store remembers as gone."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def add(self, key, value=None) -> None:
        self[key] = value
        while len(self) > self.size:
            del self[next(iter(self))]


class UnknownSession(SessionError):
    code = "unknown_session"


class SessionClosed(UnknownSession):
    """A step or call for a session its client closed (``DELETE``) on this node: ``session_closed``, a late frame
    of the client's own closing (a stream aborted with a step on its way), told apart from a node gone or restarted
    in the node's error counts (a client that did not close it repairs as for unknown_session)."""

    code = "session_closed"


class AdmissionRefused(SessionError):
    """The KV budget cannot take the session: ``kv_budget_full`` (retry later) or ``kv_budget_too_small``."""

    code = "kv_budget_full"


class StepConflict(SessionError):
    """A step number that cannot be applied: ``step_conflict``, ``stale_step``, ``step_gap``, ``position_mismatch``."""

    code = "step_conflict"


@dataclass
class StepRecord:
    """The last step a session applied: its number, a digest of its frame, and its outcome.

    ``output``: hidden states ``[T, n_embd]`` for the next hop until it answered (a retry then gets ``reply``;
    one before it, or after its relay failed, is relayed again), or None (on the head, and once answered).
    ``token`` / ``logprobs``: the head's sample (None when not sampled) and the ``n_logprobs`` most likely
    ``(id, logprob)`` pairs; ``token_logprob``: the sampled token's logprob (sessions opened with ``logprobs``).
    Logprobs are ``log_softmax`` of the raw logits (``runtime.sampling.token_logprobs``).
    ``tokens``: on the head, a verify step's samples: the token drawn after each of its positions.
    ``reply``: the bytes answered to the caller once the step completed end to end (None until then).
    ``relay``: on a node with a next hop, the asyncio.Future of that reply while the next hop has the step
    (a retry of the step meanwhile waits for it instead of pushing the step again).
    ``out_digest``: on the head of a session with ``commit``, the OUT digest of its step commitment
    (``runtime.digest.logits_digest`` of the logits rows computed and the tokens drawn); ``commit``: the step's
    signed commitment once made (node/commit.py), so that a retry answers the same one.
    """

    step: int
    digest: int
    start: int
    n_tokens: int
    output: np.ndarray | None = None  # hidden states [T, n_embd] (a torch tensor on the torch backend)
    token: int | None = None
    logprobs: list[tuple[int, float]] | None = None
    token_logprob: float | None = None
    tokens: list[int] | None = None  # a verify step's samples, one per position (speculative decoding)
    batch_size: int = 1  # steps computed in the same shared decode (compute_ms is that decode's whole time)
    compute_ms: float = 0.0
    reply: bytes | None = None
    relay: object = None
    out_digest: str | None = None
    commit: dict | None = None


@dataclass
class Session:
    """One route session on this node: its KV cache, sampler (head only) and last step."""

    id: uuid.UUID
    kv: KVPosition
    max_length: int
    next_hop: str | None = None
    wire_dtype: str = "f32"
    sampler: SamplerBase | None = None
    n_logprobs: int = 0
    want_logprob: bool = False  # the head reports the sampled token's logprob with each sample
    commit: bool = False  # every step's hop record carries this node's signed step commitment (node/commit.py)
    ctx: str = ""  # with commit: the digest of the session's commitment context (net/commitments.py)
    chain: list[tuple[int, str]] = field(default_factory=list)  # with commit: (KV position, history digest) (ibid.)
    reply_key: str | None = None  # head: the secret a reply link must present (GET /v1/link?replies=&key=)
    history: list[int] = field(default_factory=list)  # token ids of every position held (sampler, snapshots)
    history_complete: bool = True  # False once a step arrived without its token ids
    snapshot_at: int = 0  # position of the last snapshot taken (tokens)
    # Positions where the steps that filled the KV cache ended, in order, up to the first cut (a truncation or
    # restore inside a step: later steps are not recorded). llama.cpp's numerics depend on this grouping, so a
    # snapshot carries it and is restored only to one of these positions (see SnapshotLink.fetch).
    boundaries: list[int] = field(default_factory=list)
    grouping_cut: bool = False
    last: StepRecord | None = None
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    stepping: int = 0  # the server's count of steps in flight (waiting for the next hops too); touched by one thread
    hop_timeout_s: float | None = None  # seconds to wait for next_hop's answer (the server's to use)
    # quiet steps' numbers not yet read by the client (POST /v1/sessions/{id}/hops): (step, compute_ms, bytes_in,
    # kv_tokens, handle_ms), the newest max_length of them
    quiet_hops: list[tuple] = field(default_factory=list)
    # for the server: the reply future of the last quiet step it sent on, until the session's next step shows that it
    # went through (one waits per session, not one per step: a link that fails fails one)
    quiet_sent: object = None
    ring_sent: int = 0  # for the server (head): the last step number it sent itself (ring decode, node/ring.py)
    lease_s: float | None = None  # idle seconds after which the session is dropped (None: the store's ttl_s)
    lock: object = None  # for the server (e.g. an asyncio.Lock serializing this session's steps)

    @property
    def length(self) -> int:
        """Tokens held in the KV cache (= position of the next token)."""
        return self.kv.length

    def settle_quiet(self) -> None:
        """Stop waiting for the error of the last quiet step sent on (``quiet_sent``): the session's next step applied
        here, so it went through, or the session closed."""
        sent, self.quiet_sent = self.quiet_sent, None
        if sent is not None and not sent.done():
            sent.set_result(None)

    def mark_restored(self, tokens: list[int], boundaries: list[int]) -> None:
        """Record that the KV cache was just filled with ``tokens`` (their KV/state loaded from a snapshot) whose
        computation's steps ended at ``boundaries`` (ascending positions; those past ``len(tokens)`` are dropped):
        history, step boundaries (a prefix ending inside a step is a cut), and the snapshot position."""
        n = len(tokens)
        self.history[:] = tokens
        self.boundaries[:] = [b for b in boundaries if b <= n]
        self.grouping_cut = bool(n) and n not in self.boundaries  # torch: any prefix restores
        self.history_complete = True
        self.snapshot_at = n
        self.chain = [(0, self.ctx)] if self.ctx else []  # a restored prefix's history is not vouched for here


def cut_boundaries(session: Session, length: int) -> None:
    """Keep the session's step boundaries up to ``length`` tokens; a ``length`` inside a step is a cut."""
    if length and length not in session.boundaries:
        session.grouping_cut = True
    del session.boundaries[sum(1 for b in session.boundaries if b <= length) :]
