"""Prefix KV snapshots: one shard's KV cache at a position, as a safetensors blob, and its content addresses.

A snapshot holds the KV of the layers ``[start, end)`` of one model for a token prefix, in one KV dtype (llama.cpp
nodes: the sequence's state as llama.cpp writes it). Attention is causal, so one snapshot serves every prefix of
its tokens; the cache indexes it under a hash chain of its ``BLOCK_TOKENS``-token blocks (as vLLM's automatic
prefix caching does). The blob's tensors and metadata: docs/protocol.md, "Snapshots and route repair"."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import numpy as np
from safetensors.numpy import load as np_load
from safetensors.numpy import save as np_save

from ..protocol.snapshots import BLOCK_TOKENS

FORMAT = "ggufswarm-kv/1"
KV_DTYPES = ("float32", "bfloat16", "float16")  # torch backend KV dtypes (torch.<name>); tensors read with torch
STATE_DTYPE = "llama.cpp-f16"  # a llama.cpp sequence state (f16 KV cache) instead of per-layer K/V tensors


class SnapshotError(ValueError):
    """A blob that is not a valid snapshot, or one that does not fit the shard it is restored into; protocol code
    ``bad_snapshot`` (400)."""

    code = "bad_snapshot"


@dataclass(frozen=True)
class Shard:
    """What a snapshot is of: model fingerprint (hex), layer range ``[start, end)``, KV dtype name, and a
    ``scope``: "" (any session may restore it) or the hex id of the one session whose snapshots these are.

    Nodes file their snapshots unscoped, so any session can reuse any other's prefix; a llama.cpp snapshot
    carries its step boundaries instead, which keeps its restores exact (see SnapshotLink.fetch). A scope
    keeps snapshots private to one session, for a caller that wants that."""

    model: str
    start: int
    end: int
    dtype: str
    scope: str = ""

    def tag(self) -> bytes:
        scope = f"\0{self.scope}" if self.scope else ""
        return f"{self.model}\0{self.start}:{self.end}\0{self.dtype}{scope}".encode()


def valid_scope(scope) -> bool:
    """Whether ``scope`` is "" or a 32-hex-digit session id."""
    return isinstance(scope, str) and (scope == "" or re.fullmatch(r"[0-9a-f]{32}", scope) is not None)


def _ids(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def snapshot_key(shard: Shard, tokens) -> str:
    """Content address of a snapshot (hex SHA-256 of shard + the int32 token prefix)."""
    return hashlib.sha256(FORMAT.encode() + b"\0" + shard.tag() + b"\0" + _ids(tokens)).hexdigest()


def prefix_hashes(shard: Shard, tokens) -> list[str]:
    """Chain hashes of the whole ``BLOCK_TOKENS`` blocks of ``tokens``: entry ``k-1`` names the prefix
    ``tokens[0:k*BLOCK_TOKENS]`` of this shard (hex SHA-256, each over the previous one and the block)."""
    ids = _ids(tokens)
    h = hashlib.sha256(b"ggufswarm-prefix/1\0" + shard.tag()).digest()
    out = []
    step = 4 * BLOCK_TOKENS
    for off in range(0, len(ids) - step + 1, step):
        h = hashlib.sha256(h + ids[off : off + step]).digest()
        out.append(h.hex())
    return out


@dataclass
class Snapshot:
    """A decoded snapshot: ``tokens`` int64 ``[n]`` (numpy), per-layer ``keys`` / ``values`` ``[n, n_head_kv,
    head_dim]``
    (torch tensors), or ``state`` (llama.cpp sequence state bytes, keys/values empty; decoding it needs no torch)."""

    shard: Shard
    tokens: np.ndarray
    keys: list
    values: list
    state: bytes | None = None
    boundaries: list[int] = field(default_factory=list)  # step ends of the computation (see encode_snapshot)
    node: str = ""  # id of the node that took it ("" when unnamed): its ed25519 key when signed
    sig: str = ""  # the node's signature of ``content_digest()`` (net/identity.py; "" when unsigned)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def key(self) -> str:
        return snapshot_key(self.shard, self.tokens.tolist())

    def check_signature(self) -> bool:
        """Whether the snapshot is signed: True when ``sig`` verifies as ``node``'s ed25519 signature of
        ``content_digest()``, False when unsigned; SnapshotError for a signature that does not verify (forged, or
        content changed after signing)."""
        if not self.sig:
            return False
        from ..net.identity import IdentityError, verify

        try:
            verify(self.node, self.content_digest().encode(), self.sig)
        except IdentityError as exc:
            raise SnapshotError(f"snapshot signature of node {self.node[:16]!r} does not verify: {exc}") from None
        return True

    def content_digest(self) -> str:
        """SHA-256 of what the snapshot holds (shard, tokens, boundaries, K/V or state), not of its blob: the
        blob's JSON header lists its metadata in no fixed order, and names the node that took it."""
        h = hashlib.sha256(self.shard.tag() + b"\0" + _ids(self.tokens.tolist()) + b"\0" + _ids(self.boundaries))
        if self.keys:  # a torch-backend snapshot: its K/V are torch tensors
            import torch

            for t in self.keys + self.values:
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(self.state or b"")
        return h.hexdigest()


def encode_snapshot(
    shard: Shard,
    tokens: list[int],
    keys: list,
    values: list,
    state: bytes | None = None,
    boundaries: list[int] | None = None,
    node: str = "",
    identity=None,
) -> bytes:
    """A safetensors blob of one shard's KV for ``tokens`` (``keys[i]`` / ``values[i]``: torch ``[n, ...]`` per layer,
    already sliced to ``len(tokens)`` positions; or a llama.cpp ``state`` holding exactly those positions, written
    without torch). ``boundaries``: the positions where the steps that computed it ended (ascending, each in
    ``1..n``; stored as int32 ``boundaries``): a llama.cpp snapshot is restored only up to one of them. ``node``:
    the id of the node taking it (metadata ``node``; the cache logs it when it refuses an upload); ``identity``
    (a net.identity.NodeIdentity): sign it — ``node`` becomes the node's key and metadata ``sig`` its signature of
    ``Snapshot.content_digest()``, which caches and restoring nodes check. Copies the tensors; safe to call off the
    event loop. SnapshotError for parts that do not fit together."""
    n = len(tokens)
    bounds = list(boundaries or [])
    if any(not 0 < b <= n for b in bounds) or bounds != sorted(set(bounds)):
        raise SnapshotError(f"boundaries must ascend within 1..{n}, got {bounds[:8]}...")
    head = {"tokens": np.asarray(tokens, dtype=np.int32)}
    if bounds:
        head["boundaries"] = np.asarray(bounds, dtype=np.int32)
    meta = {
        "format": FORMAT,
        "model": shard.model,
        "layers": f"{shard.start}:{shard.end}",
        "dtype": shard.dtype,
        "n_tokens": str(n),
        "scope": shard.scope,
        "node": str(node)[:64],
    }
    if identity is not None:
        unsigned = Snapshot(shard, np.asarray(tokens, dtype=np.int64), keys, values, state, bounds)
        meta["node"], meta["sig"] = identity.key_id, identity.sign(unsigned.content_digest().encode())
    if shard.dtype == STATE_DTYPE:
        if state is None:
            raise SnapshotError("a llama.cpp snapshot needs the sequence state")
        return np_save({**head, "state": np.frombuffer(state, dtype=np.uint8)}, metadata=meta)
    if len(keys) != shard.end - shard.start or len(values) != len(keys):
        raise SnapshotError(
            f"layers {shard.start}:{shard.end} need {shard.end - shard.start} K/V pairs, got {len(keys)}/{len(values)}"
        )
    import torch  # torch-backend K/V (bfloat16 among them: safetensors' numpy side has no bfloat16)
    from safetensors.torch import save as st_save

    tensors = {name: torch.from_numpy(arr) for name, arr in head.items()}
    for i, (k, v) in enumerate(zip(keys, values)):
        if k.shape[0] != n or v.shape[0] != n:
            raise SnapshotError(f"layer {i}: K/V hold {k.shape[0]}/{v.shape[0]} positions, tokens {n}")
        tensors[f"k.{i}"] = k.contiguous()
        tensors[f"v.{i}"] = v.contiguous()
    return st_save(tensors, metadata=meta)


def decode_snapshot(blob: bytes) -> Snapshot:
    """Parse and check a snapshot blob; SnapshotError when it is not one, its parts disagree, or its K/V
    hold NaN/inf (a restore must never poison a session; the cache refuses such uploads too)."""
    try:
        meta = _metadata(blob)
        if meta.get("dtype") not in (*KV_DTYPES, STATE_DTYPE):
            raise SnapshotError(f"unknown snapshot dtype {meta.get('dtype')!r}")
        if meta.get("dtype") == STATE_DTYPE:  # a llama.cpp state: numpy only
            tensors = np_load(blob)
        else:  # torch-backend K/V
            from safetensors.torch import load as st_load

            tensors = {name: t.numpy() if name in ("tokens", "boundaries") else t for name, t in st_load(blob).items()}
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"not a safetensors snapshot: {exc}") from None
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"snapshot format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        start, end = (int(x) for x in meta["layers"].split(":"))
        shard = Shard(meta["model"], start, end, meta["dtype"], meta.get("scope", ""))
        n = int(meta["n_tokens"])
    except (KeyError, ValueError):
        raise SnapshotError(f"snapshot metadata incomplete: {meta}") from None
    if not re.fullmatch(r"[0-9a-f]{64}", shard.model) or not 0 <= start < end or not valid_scope(shard.scope):
        raise SnapshotError(
            "snapshot model must be a 64-hex-digit GGUF fingerprint, layers start:end, "
            "scope empty or a 32-hex-digit session id"
        )
    tokens = tensors.get("tokens")
    if (
        tokens is None
        or tokens.dtype != np.int32
        or tokens.shape != (n,)
        or (shard.dtype not in KV_DTYPES and shard.dtype != STATE_DTYPE)
    ):
        raise SnapshotError("snapshot tokens missing or not int32 [n_tokens], or unknown dtype")
    if n and int(tokens.min()) < 0:
        raise SnapshotError("snapshot token ids must be non-negative")
    node, sig = str(meta.get("node", ""))[:64], str(meta.get("sig", ""))[:128]
    bounds = tensors.pop("boundaries", None)
    if bounds is not None:
        if bounds.dtype != np.int32 or bounds.ndim != 1:
            raise SnapshotError("snapshot boundaries must be int32 [k]")
        bounds = bounds.tolist()
        if any(not 0 < b <= n for b in bounds) or bounds != sorted(set(bounds)):
            raise SnapshotError(f"snapshot boundaries must ascend within 1..{n}")
    if shard.dtype == STATE_DTYPE:
        state = tensors.get("state")
        if state is None or state.dtype != np.uint8 or state.ndim != 1 or len(tensors) != 2:
            raise SnapshotError("llama.cpp snapshot needs exactly a uint8 [bytes] state and its tokens")
        return Snapshot(shard, tokens.astype(np.int64), [], [], state.tobytes(), bounds or [], node, sig)
    import torch

    keys, values = [], []
    for i in range(end - start):
        k, v = tensors.get(f"k.{i}"), tensors.get(f"v.{i}")
        if (
            k is None
            or v is None
            or k.dim() != 3
            or k.shape[0] != n
            or v.shape[:2] != k.shape[:2]
            or v.dim() != 3
            or k.dtype != getattr(torch, shard.dtype)
            or v.dtype != k.dtype
        ):
            raise SnapshotError(f"snapshot layer {i} K/V missing or mis-shaped")
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise SnapshotError(f"snapshot layer {i} K/V hold NaN/inf")
        keys.append(k)
        values.append(v)
    return Snapshot(shard, tokens.astype(np.int64), keys, values, boundaries=bounds or [], node=node, sig=sig)


def _metadata(blob: bytes) -> dict:
    """The ``__metadata__`` of a safetensors blob (its JSON header, after the 8-byte length)."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
