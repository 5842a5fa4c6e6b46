"""The llama.cpp shard's batching policy: which sessions' decode steps share one ``llama_decode`` and how they
are ordered so that each shared ubatch stays bitwise the steps run alone.

How many sessions per ubatch stay bitwise (``INVARIANT_BATCH_GROUP`` with llama.cpp patch 0005's batch-invariant
decode, ``EXACT_BATCH_GROUP`` without it), why a long session with several threads decodes alone, and the unified-KV
throughput mode: docs/protocol.md, "How a node schedules steps" (Exactness, Throughput mode, Gathering). Measured in
``bench/bench_batching.py`` and asserted in ``tests/test_batching.py``.
"""

from __future__ import annotations

import heapq
import os
from typing import TYPE_CHECKING

import numpy as np

from .bindings import L
from .errors import LlamaCppError
from .patches import applied
from .seq import SeqKV

if TYPE_CHECKING:
    from .backend import LlamaCppShard

EXACT_BATCH_GROUP = 3  # most sessions per ubatch whose results stay bitwise their steps alone (docs/protocol.md)
# ... with patch 0005 (every session's row computed by the kernels of a single row): bounded only by what one
# llama_decode should hold
INVARIANT_BATCH_GROUP = 64
THROUGHPUT_BATCH_GROUP = 32  # unified KV: most sessions per ubatch (not bitwise)
INVARIANT_PATCH = "0005-batch-invariant-decode"
INVARIANT_ENV = "LLAMA_BATCH_INVARIANT"  # read by libllama (patch 0005) when a context is created
SPLIT_KV_TOKENS = 256  # from this many tokens held a decode step attends to 512+ cells (``solo``)


def forward_batch(shard: LlamaCppShard, steps: list[tuple]) -> list[np.ndarray | Exception]:
    """Run one step of each of several sessions on ``shard``; the decode steps (T = 1) together in one
    ``llama_decode``.

    ``steps``: ``(kv, inputs)`` or ``(kv, inputs, token_ids)`` of *different* sessions, as for
    ``LlamaCppShard.forward``. Returns one entry per step, in order: what ``forward`` would return (hidden states
    ``[T, n_embd]`` float32, at the head the last position's logits ``[1, n_vocab]`` float32), or the exception
    that step raised (the others are unaffected; on an error a session's KV cache is as before the call).

    The single-token steps go into one ``llama_batch``, one sequence id each, ordered by ``grouped``. Steps of
    more than one token run one after another through ``forward`` (their ubatch split is then the one they get
    alone). When llama.cpp fails the shared decode (no free cells, an abort), it has rolled every sequence back
    and each of those steps is run again alone, with its own result or error. Shards whose batches are not
    checked against llama.cpp alone (recurrent state, M-RoPE positions, token-id batches) run every step alone.
    ValueError when two steps belong to the same session.
    """
    if len({id(step[0]) for step in steps}) != len(steps):
        raise ValueError("forward_batch takes at most one step per session")
    if shard.exact_states_only or shard.n_pos_per_token != 1 or shard.needs_token_ids:
        return [_forward_one(shard, step[0], np.asarray(step[1]), *step[2:]) for step in steps]
    steps = [(step[0], np.asarray(step[1])) for step in steps]
    results: list = [None] * len(steps)
    decode = []  # (index in steps, (kv, ids, embd, token ids)) of the single-token steps that checked out
    for i, (kv, inputs) in enumerate(steps):
        if int(inputs.shape[0]) != 1:
            continue
        try:
            decode.append((i, (kv, *shard.prepare_step(kv, inputs))))
        except Exception as exc:
            results[i] = exc
    if len(decode) == 1:  # nothing to share a decode with
        i = decode[0][0]
        results[i] = _forward_one(shard, *steps[i])
    elif decode:
        compact(shard, [d[1][0] for d in decode])
        groups = ubatch_groups(shard, decode)
        shard.decode_ubatches += len(groups)
        shard.largest_ubatch = max(shard.largest_ubatch, *map(len, groups))
        decode = [d for g in groups for d in g]
        try:
            rows = shard.decode_steps([step for _, step in decode], logits="all")
            outs = [rows[j : j + 1] for j in range(len(decode))]
        except LlamaCppError:  # llama.cpp rolled the whole batch back: each step alone
            outs = [_forward_one(shard, *steps[i]) for i, _ in decode]
        for (i, _), out in zip(decode, outs):
            results[i] = out
    for i, (kv, inputs) in enumerate(steps):
        if int(inputs.shape[0]) != 1:
            results[i] = _forward_one(shard, kv, inputs)
    return results


def ubatch_groups(shard: LlamaCppShard, decode: list[tuple[int, tuple]]) -> list[list[tuple[int, tuple]]]:
    """``decode`` (``(index, (kv, ...))`` entries) cut into the ubatches llama.cpp will make of them, in the order
    to put them in the batch: with a KV stream per session, llama.cpp's sequential ``split_equal`` makes each
    ubatch one group of at most ``shard.batch_group`` consecutive sequence ids: sorted by id, cut into groups,
    the groups in descending order (a ubatch takes the first unused token's sequence and then ids +1, +2, ...
    found later in the batch; the next id after a group's last is absent or in a group placed before it, already
    used). With unified KV (one stream) llama.cpp takes any sequences into a ubatch: one group sorted by id."""
    decode = sorted(decode, key=lambda d: d[1][0].seq_id)
    if shard.kv_unified:
        return [decode]
    groups, run = [], []
    for d in decode:
        kv, last = d[1][0], run[-1][1][0] if run else None
        if run and (
            kv.seq_id != last.seq_id + 1 or len(run) >= shard.batch_group or solo(shard, last) or solo(shard, kv)
        ):
            groups.append(run)
            run = []
        run.append(d)
    groups.append(run)
    return groups[::-1]


def enable_batch_invariance() -> bool:
    """Turn patch 0005's batch-invariant decode on for the llama.cpp contexts created from now on in this process
    (``LLAMA_BATCH_INVARIANT=1`` unless the user set it, e.g. to 0). Returns whether those contexts will have it:
    the loaded libllama carries the patch and the variable is on."""
    os.environ.setdefault(INVARIANT_ENV, "1")
    try:
        on = int(os.environ[INVARIANT_ENV]) != 0
    except ValueError:
        on = False
    return on and applied(INVARIANT_PATCH)


def default_batch_group(kv_unified: bool, invariant: bool) -> int:
    """Most sessions per shared ubatch by default: ``THROUGHPUT_BATCH_GROUP`` with unified KV; else as many as stay
    bitwise alone (``INVARIANT_BATCH_GROUP`` with batch-invariant decode, ``EXACT_BATCH_GROUP`` without)."""
    if kv_unified:
        return THROUGHPUT_BATCH_GROUP
    return INVARIANT_BATCH_GROUP if invariant else EXACT_BATCH_GROUP


def compact(shard: LlamaCppShard, kvs: list[SeqKV]) -> int:
    """Give the sessions ``kvs`` (whose decode steps are about to share a ``llama_decode``) consecutive sequence ids,
    so that llama.cpp puts them in one ubatch: with a KV stream per session it takes only consecutive ids into a
    ubatch, and the sessions a node is handed together are any of its sessions (on a route, the cohorts that move
    through it together). Only with batch-invariant decode (where one ubatch of them all stays bitwise each alone)
    and a spare stream (``shard.spare_seq``).

    The block of ``len(kvs)`` ids already holding the most of them is chosen; each of the others takes a free id in
    it, or swaps ids with the session holding one (through the spare). A session's cells move with llama.cpp's
    cross-stream ``llama_memory_seq_cp`` (the stream's buffer copied at the next ``llama_decode``, every cell at the
    same index: its attention reads them in the same order, so its results stay bitwise) and its ``SeqKV.seq_id``
    changes. A cohort is moved once; later batches of it are consecutive already. Returns the stream copies made.
    Sessions that decode alone (``solo``) are left where they are."""
    if not shard.batch_invariant or shard.spare_seq is None:
        return 0
    kvs = sorted((kv for kv in kvs if not solo(shard, kv)), key=lambda kv: kv.seq_id)
    ids, m = [kv.seq_id for kv in kvs], len(kvs)
    if m < 2 or ids[-1] - ids[0] == m - 1 or m > shard.batch_group:
        return 0
    mine = set(ids)
    start = max(range(shard.n_seq_max - m + 1), key=lambda b: (sum(b <= i < b + m for i in ids), -b))
    copies = 0
    with shard._lock:  # the shard's step lock (reentrant): no step runs while ids move
        holders = {kv.seq_id: kv for kv in list(shard._sessions) if not kv.closed}
        targets = [t for t in range(start, start + m) if t not in mine]
        for kv, t in zip([kv for kv in kvs if not start <= kv.seq_id < start + m], targets):
            if t in shard._free_seqs:  # a free id: take it, give ours back
                shard._free_seqs.remove(t)
                src = kv.seq_id
                _move(shard, kv, t)
                shard._free_seqs.append(src)
                heapq.heapify(shard._free_seqs)
                copies += 1
            elif t in holders:  # another session's: swap the two through the spare stream
                a, other = kv.seq_id, holders[t]
                _move(shard, kv, shard.spare_seq)
                _move(shard, other, a)
                _move(shard, kv, t)
                copies += 3
    shard.stream_copies += copies
    return copies


def _move(shard: LlamaCppShard, kv: SeqKV, dst: int) -> None:
    """Move session ``kv``'s cells from its sequence id to the free id ``dst`` (cross-stream copy: see compact)."""
    L.llama_memory_seq_cp(shard._mem, kv.seq_id, dst, -1, -1)
    L.llama_memory_seq_rm(shard._mem, kv.seq_id, -1, -1)
    kv.seq_id = dst


def solo(shard: LlamaCppShard, kv: SeqKV) -> bool:
    """Whether this session's decode step must have a ubatch of its own to stay bitwise its step alone: with more
    than one thread, llama.cpp's CPU flash attention splits the KV cells among the threads only for a ubatch of one
    sequence holding 512+ cells (``use_split_kv_path``, ggml-cpu/ops.cpp; llama.cpp pads the cells it attends to
    to 256, so from ``SPLIT_KV_TOKENS`` on). Only in the exact mode (one KV stream per session)."""
    return not shard.kv_unified and shard.threads > 1 and kv.length >= SPLIT_KV_TOKENS


def _forward_one(shard: LlamaCppShard, kv: SeqKV, inputs: np.ndarray, token_ids=None) -> np.ndarray | Exception:
    """``shard.forward`` of one step, its exception returned instead of raised."""
    try:
        return shard.forward(kv, inputs, token_ids=token_ids)
    except Exception as exc:
        return exc


__all__ = [
    "EXACT_BATCH_GROUP",
    "INVARIANT_BATCH_GROUP",
    "SPLIT_KV_TOKENS",
    "THROUGHPUT_BATCH_GROUP",
    "compact",
    "default_batch_group",
    "enable_batch_invariance",
    "forward_batch",
    "solo",
    "ubatch_groups",
]
