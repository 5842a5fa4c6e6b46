"""The llama.cpp shard's batching policy: which sessions' decode steps share one ``llama_decode`` and how they
are ordered so that each shared ubatch stays bitwise the steps run alone.

Why at most ``EXACT_BATCH_GROUP`` sessions per ubatch, why a long session with several threads decodes alone,
and the unified-KV throughput mode: docs/protocol.md, "How a node schedules steps" (Exactness, Throughput mode,
Gathering). Measured in ``bench/bench_batching.py`` and asserted in ``tests/test_batching.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .errors import LlamaCppError
from .seq import SeqKV

if TYPE_CHECKING:
    from .backend import LlamaCppShard

EXACT_BATCH_GROUP = 3  # most sessions per ubatch whose results stay bitwise their steps alone (docs/protocol.md)
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
        decode = grouped(shard, decode)
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


def grouped(shard: LlamaCppShard, decode: list[tuple[int, tuple]]) -> list[tuple[int, tuple]]:
    """``decode`` (``(index, (kv, ...))`` entries) ordered so that llama.cpp's sequential ``split_equal`` makes
    each ubatch one group of at most ``shard.batch_group`` consecutive sequence ids: sorted by id, cut into groups,
    the groups in descending order (a ubatch takes the first unused token's sequence and then ids +1, +2, ...
    found later in the batch; the next id after a group's last is absent or in a group placed before it, already
    used). With unified KV (one stream) llama.cpp takes any sequences into a ubatch: sorted by id only."""
    decode = sorted(decode, key=lambda d: d[1][0].seq_id)
    if shard.kv_unified:
        return decode
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
    return [d for g in reversed(groups) for d in g]


def solo(shard: LlamaCppShard, kv: SeqKV) -> bool:
    """Whether this session's decode step must have a ubatch of its own to stay bitwise its step alone: with more
    than one thread, llama.cpp's CPU flash attention splits the KV cells among the threads only for a ubatch of one
    sequence holding 512+ cells (``use_split_kv_path``, ggml-cpu/ops.cpp; llama.cpp pads the cells it attends to
    to 256, so from ``SPLIT_KV_TOKENS`` on). Only in the exact mode (``batch_group`` <= ``EXACT_BATCH_GROUP``)."""
    return shard.batch_group <= EXACT_BATCH_GROUP and shard.threads > 1 and kv.length >= SPLIT_KV_TOKENS


def _forward_one(shard: LlamaCppShard, kv: SeqKV, inputs: np.ndarray, token_ids=None) -> np.ndarray | Exception:
    """``shard.forward`` of one step, its exception returned instead of raised."""
    try:
        return shard.forward(kv, inputs, token_ids=token_ids)
    except Exception as exc:
        return exc


__all__ = ["EXACT_BATCH_GROUP", "SPLIT_KV_TOKENS", "forward_batch", "grouped", "solo"]
