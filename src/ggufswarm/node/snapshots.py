"""A node's link to the snapshot cache: background KV snapshots of its sessions, and restores from it.

Snapshots are taken after a sampled prefill and each time a session reaches a multiple of ``every``
tokens. Taking one costs the step nothing: the step handler only records views of the KV buffers (positions
``< n`` are never written again unless the session is truncated, which bumps ``SessionKV.epoch``); serialization and
upload run on a separate thread and task, and a snapshot whose session was truncated meanwhile is
dropped. One snapshot per session is in flight at a time; a due one meanwhile is skipped, except that a
shard which truncates only to exact states (recurrent blocks, ``deepseek4``) still copies the state into the
session's checkpoints there (a route repair may restore another node's snapshot of that position).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from ..cache.snapshot import KV_DTYPES, STATE_DTYPE, Shard, SnapshotError, decode_snapshot, encode_snapshot
from ..protocol.snapshots import BLOCK_TOKENS, SHA_HEADER
from ..runtime.backends import ShardBackend
from ..runtime.session_state import Session


class SnapshotLink:
    """Snapshots to and restores from the cache server at ``url`` for one shard.

    ``every``: tokens between snapshots of a session after its prefill (0 = after prefill only); ``executor``: the
    node's shard backend (a ``state_snapshots`` one has its sequence state copied under the session's lock).
    ``counters``: a dict of ints the node exports (written, bytes, dropped, failed, restored).
    """

    def __init__(self, url: str, shard: Shard, every: int, client_factory, executor: ShardBackend, identity=None):
        self.url = url.rstrip("/")
        self.executor = executor
        self.shard = shard
        self.identity = identity  # net.identity.NodeIdentity: signs every snapshot this node takes (None: unsigned)
        self.banned = lambda key: False  # the swarm's ban check (key -> bool): a banned node's snapshots never restore
        self.every = every
        self._client = client_factory  # () -> aiohttp.ClientSession (the node's, with the swarm token)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")  # encodes snapshots, one at a time
        self._copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")  # never behind an upload
        self._inflight: set = set()
        self._tasks: set[asyncio.Task] = set()
        self._warned = False
        # written: stored; kept: the cache already held that key (the same bytes, or another node's: first wins)
        self.counters = {
            "written": 0,
            "kept": 0,
            "bytes": 0,
            "dropped": 0,
            "failed": 0,
            "restored": 0,
            "restored_tokens": 0,
        }

    # -- snapshots ---------------------------------------------------------------------------------
    def uploading(self, session_id) -> bool:
        """Whether a snapshot of session ``session_id`` is being encoded or uploaded now (the next due position
        of that session is skipped meanwhile)."""
        return session_id in self._inflight

    def after_step(self, session: Session, prefill_sampled: bool) -> None:
        """Called by the step handler after a step: schedule a snapshot when one is due. Never blocks."""
        n = session.length
        if n < BLOCK_TOKENS or not session.history_complete or len(session.history) != n:
            return
        # decode snapshots land on multiples of ``every`` (whole blocks when it is a multiple of BLOCK_TOKENS)
        due = prefill_sampled or (self.every > 0 and n // self.every > session.snapshot_at // self.every)
        if not due:
            return
        if session.id in self._inflight:  # the last one still uploads: this position is not snapshotted here
            if self.executor.exact_states_only:
                # but a shard that truncates only to exact states keeps it as a checkpoint all the same: another
                # node's snapshot of this position may be what a route repair restores
                session.snapshot_at = n
                task = asyncio.get_running_loop().create_task(self._checkpoint(session))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        session.snapshot_at = n
        self._inflight.add(session.id)
        if self.shard.dtype == STATE_DTYPE:
            task = asyncio.get_running_loop().create_task(self._write_state(session))
        else:
            keys = [layer.k[:n] for layer in session.kv.layers]
            values = [layer.v[:n] for layer in session.kv.layers]
            task = asyncio.get_running_loop().create_task(
                self._write(
                    session, list(session.history), keys, values, session.kv.epoch, boundaries=list(session.boundaries)
                )
            )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _checkpoint(self, session: Session) -> None:
        """An exact-state shard: copy the session's state into its checkpoints (``state_bytes``), no upload."""
        try:
            async with session.lock:
                if not session.kv.closed:
                    await asyncio.get_running_loop().run_in_executor(
                        self._copy_pool, self.executor.state_bytes, session.kv
                    )
        except Exception as exc:
            self.counters["failed"] += 1
            print(f"ggufswarm node: state checkpoint failed ({exc}); still serving", file=sys.stderr, flush=True)

    async def _write_state(self, session: Session) -> None:
        """A ``state_snapshots`` shard: copy the sequence state once the step handler releases the session (the
        next step of the session waits for the copy), then encode and upload as ``_write``."""
        try:
            async with session.lock:
                n = session.length
                if session.kv.closed or not session.history_complete or len(session.history) != n:
                    self._inflight.discard(session.id)
                    return
                tokens = list(session.history)
                boundaries = list(session.boundaries)
                state = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.executor.state_bytes, session.kv
                )
                epoch = session.kv.epoch
        except Exception as exc:
            self._inflight.discard(session.id)
            self.counters["failed"] += 1
            print(f"ggufswarm node: snapshot state copy failed ({exc}); still serving", file=sys.stderr, flush=True)
            return
        await self._write(session, tokens, [], [], epoch, state, boundaries)

    async def _write(
        self,
        session: Session,
        tokens,
        keys,
        values,
        epoch: int,
        state: bytes | None = None,
        boundaries: list[int] | None = None,
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
            blob = await loop.run_in_executor(
                self.pool, encode_snapshot, self.shard, tokens, keys, values, state, boundaries, "", self.identity
            )
            if session.kv.epoch != epoch:  # truncated while we copied: positions may have been rewritten
                self.counters["dropped"] += 1
                return
            async with self._client().post(
                self.url + "/v1/snapshots",
                data=blob,
                headers={"Content-Type": "application/octet-stream"},
                timeout=aiohttp.ClientTimeout(total=60),
            ) as resp:
                if resp.status in (200, 409):  # the key is taken (by these bytes or others): the first stays
                    self.counters["kept"] += 1
                    return
                if resp.status != 201:
                    raise RuntimeError(f"cache answered {resp.status}: {(await resp.text())[:200]}")
            self.counters["written"] += 1
            self.counters["bytes"] += len(blob)
            self._warned = False
        except (TimeoutError, aiohttp.ClientError, RuntimeError, SnapshotError) as exc:
            self.counters["failed"] += 1
            if not self._warned:
                print(
                    f"ggufswarm node: snapshot to {self.url} failed ({exc}); still serving", file=sys.stderr, flush=True
                )
                self._warned = True
        finally:
            self._inflight.discard(session.id)

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for snapshots in flight (at shutdown, and for tests)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    # -- restores ----------------------------------------------------------------------------------
    async def fetch(self, tokens: list[int], boundaries: list[int] | None = None) -> tuple[object, int, str]:
        """The longest cached prefix of ``tokens`` for this shard: ``(snapshot, length, reason)``.

        The cache finds whole 16-token blocks; ``length`` extends to every token the snapshot shares. On a
        llama.cpp shard (whose numerics depend on how tokens were grouped into steps) ``length`` is then cut
        back to a step boundary of the snapshot: the restored KV is exactly what llama.cpp left after those
        steps. With ``boundaries`` (a route repair: the session's own step ends, ascending) the snapshot's
        steps must also be the session's, up to ``length``: the repaired session continues bit for bit.
        On a recurrent llama.cpp shard (hybrid models) only the whole snapshot restores (``length`` equal to
        its ``n_tokens``): its recurrent state exists at that position alone.

        ``snapshot`` is None (``length`` 0) on a miss or when the cache fails in any way (unreachable,
        corrupt, a blob that does not match, unsigned, a signature that does not verify, taken by a banned node): a
        restore falls back to recomputing, it never fails.
        """
        client = self._client()
        shard = self.shard
        try:
            body = {
                "model": shard.model,
                "layers": [shard.start, shard.end],
                "dtype": shard.dtype,
                "scope": shard.scope,
                "tokens": tokens,
            }
            async with client.post(self.url + "/v1/lookup", json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return None, 0, f"cache lookup answered {r.status}"
                found = await r.json()
            if not found.get("key"):
                return None, 0, "no cached prefix"
            async with client.get(
                f"{self.url}/v1/snapshots/{found['key']}", timeout=aiohttp.ClientTimeout(total=60)
            ) as r:
                if r.status != 200:
                    return None, 0, f"cache answered {r.status} for snapshot {found['key'][:12]}"
                blob = await r.read()
                sha = r.headers.get(SHA_HEADER)
            loop = asyncio.get_running_loop()
            if sha != await loop.run_in_executor(self.pool, lambda: hashlib.sha256(blob).hexdigest()):
                return None, 0, "snapshot failed its SHA-256 check in transit"
            snap = await loop.run_in_executor(self.pool, decode_snapshot, blob)
            if not await loop.run_in_executor(self.pool, snap.check_signature):
                return None, 0, "cached snapshot is unsigned: restored only from a node's signed snapshot"
            if self.banned(snap.node):
                return None, 0, f"cached snapshot was taken by node {snap.node[:16]}…, which the swarm banned"
            length = int(found["length"])
            held = snap.tokens.tolist()
            if snap.shard != shard or snap.n_tokens < length or held[:length] != tokens[:length]:
                return None, 0, "cached snapshot does not match this shard or prefix"
            # the index finds whole 16-token blocks; the snapshot may share more (up to the step where it was
            # taken): restore all of that, so a route repair can roll back to a step boundary and replay exactly
            while length < min(len(held), len(tokens)) and held[length] == tokens[length]:
                length += 1
            if snap.state is not None:
                length = grouped_length(snap.boundaries, length, boundaries)
                if not length:
                    return (
                        None,
                        0,
                        "no step of the cached computation ends inside the shared prefix"
                        + ("" if boundaries is None else " with this session's steps"),
                    )
                if self.executor.exact_states_only and length != snap.n_tokens:
                    # a recurrent state is the state at exactly n_tokens: it cannot be cut back to a shorter prefix
                    return (
                        None,
                        0,
                        (
                            f"the cached recurrent state holds {snap.n_tokens} tokens, of which only {length} "
                            f"are usable here; a recurrent state restores only at its exact position"
                        ),
                    )
            return snap, length, "restored"
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:  # SnapshotError too
            return None, 0, f"cache failed: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._copy_pool.shutdown(wait=False, cancel_futures=True)


def grouped_length(snapshot_bounds: list[int], shared: int, wanted: list[int] | None = None) -> int:
    """The longest restorable prefix of a llama.cpp snapshot: its last step boundary ``<= shared`` tokens, and
    with ``wanted`` (ascending step ends of the session being repaired) the last one up to which both lists
    agree (0: none)."""
    best = 0
    for i, b in enumerate(snapshot_bounds):
        if b > shared or (wanted is not None and (i >= len(wanted) or wanted[i] != b)):
            break
        best = b
    return best


def shard_of(executor: ShardBackend) -> Shard:
    """The Shard (model fingerprint, layers, KV dtype or llama.cpp state) a node's executor computes."""
    if executor.state_snapshots:
        return Shard(executor.model.fingerprint, executor.spec.start, executor.spec.end, STATE_DTYPE)
    dtype = next(name for name in KV_DTYPES if f"torch.{name}" == str(executor.dtype))
    return Shard(executor.model.fingerprint, executor.spec.start, executor.spec.end, dtype)
