"""Node identities: an ed25519 key pair per node (the ``cryptography`` library), signed JSON records.

A node's id in the swarm is its public key (``key_id``: 64 hex characters, the raw 32-byte ed25519 public key), so a
tracker, a DHT peer or a gateway names a node by something it cannot choose again: a node banned by key does not come
back under another port or address. What a node signs (its advertisement, its step commitments) is a JSON object in a
canonical form (``canonical``: keys sorted, no spaces, UTF-8), with the signature in a field outside the signed bytes.
Signatures are ed25519 (RFC 8032), 64 bytes, as 128 hex characters (docs/protocol.md, "Node identities and bans")."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

KEY_FILE = "identity.key"  # in a node's --data-dir: the raw 32-byte ed25519 private key, mode 0600
KEY_HEX_CHARS = 64
SIG_HEX_CHARS = 128


class IdentityError(ValueError):
    """A key file that cannot be read, a malformed key id, or a signature that does not verify."""


def canonical(obj: dict) -> bytes:
    """The bytes a signature covers: ``obj`` as JSON with sorted keys and no whitespace (UTF-8).
    TypeError / ValueError for what JSON cannot carry (NaN included)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


class NodeIdentity:
    """A node's ed25519 key pair. ``key_id``: the public key, 64 lowercase hex characters (the node's id)."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self._lock = None  # the key file's lock (claim)
        self.path: Path | None = None  # the key file (load_or_create, claim)
        raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key_id = raw.hex()

    @classmethod
    def generate(cls) -> NodeIdentity:
        """A fresh key pair (kept in memory only)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | Path) -> NodeIdentity:
        """The key pair in ``path`` (32 raw bytes), created there (mode 0600, its folder made) when absent: a node
        keeps its identity across restarts. IdentityError when the file is not a 32-byte key."""
        path = Path(path)
        if path.exists():
            raw = path.read_bytes()
            if len(raw) != 32:
                raise IdentityError(f"{path}: an identity key is 32 bytes, this file has {len(raw)}")
            return cls(Ed25519PrivateKey.from_private_bytes(raw))
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        return cls(key)

    @classmethod
    def claim(cls, data_dir: str | Path, tries: int = 64) -> NodeIdentity:
        """The identity of a node using ``data_dir``: ``identity.key`` there, held with an exclusive lock for the
        life of the process; when another running node holds it (several nodes started in one folder),
        ``identity-1.key``, ``identity-2.key``, … in turn. The first start creates the key; a restart takes the same
        one again. IdentityError when ``tries`` keys are all held or a key file is malformed."""
        folder = Path(data_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(tries):
            path = folder / (KEY_FILE if i == 0 else KEY_FILE.replace(".key", f"-{i}.key"))
            lock = open(str(path) + ".lock", "a+b")
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                continue
            ident = cls.load_or_create(path)
            ident.path = path
            ident._lock = lock  # released when the identity is garbage-collected or the process exits
            return ident
        raise IdentityError(f"{folder}: {tries} identity keys are all held by running nodes")

    def sign(self, data: bytes) -> str:
        """The ed25519 signature of ``data``, 128 hex characters."""
        return self._private.sign(data).hex()

    def sign_json(self, obj: dict, field: str = "sig") -> dict:
        """``obj`` with ``field`` set to the signature of ``canonical(obj without field)`` (a new dict)."""
        body = {k: v for k, v in obj.items() if k != field}
        return {**body, field: self.sign(canonical(body))}


def public_key(key_id: str) -> Ed25519PublicKey:
    """The public key named by ``key_id`` (64 hex characters). IdentityError when malformed."""
    if not isinstance(key_id, str) or len(key_id) != KEY_HEX_CHARS:
        raise IdentityError(f"a node key is {KEY_HEX_CHARS} hex characters, got {str(key_id)[:80]!r}")
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(key_id))
    except ValueError:
        raise IdentityError(f"a node key is {KEY_HEX_CHARS} hex characters, got {key_id[:80]!r}") from None


def verify(key_id: str, data: bytes, sig: str) -> None:
    """Check that ``sig`` (128 hex characters) is ``key_id``'s signature of ``data``. IdentityError when not."""
    key = public_key(key_id)
    try:
        if not isinstance(sig, str) or len(sig) != SIG_HEX_CHARS:
            raise ValueError
        key.verify(bytes.fromhex(sig), data)
    except (InvalidSignature, ValueError):
        raise IdentityError(f"the signature does not verify against key {key_id[:16]}…") from None


def verify_json(obj: dict, key_id: str, field: str = "sig") -> dict:
    """Check ``obj[field]`` is ``key_id``'s signature of the rest of ``obj`` (``sign_json``); returns the rest.
    IdentityError when the field is missing or the signature does not verify."""
    if not isinstance(obj, dict) or field not in obj:
        raise IdentityError(f"unsigned: no {field!r} field")
    body = {k: v for k, v in obj.items() if k != field}
    try:
        data = canonical(body)
    except (TypeError, ValueError) as exc:
        raise IdentityError(f"cannot be signed: {exc}") from None
    verify(key_id, data, obj[field])
    return body


def deregistration(key: str, signed_at: float) -> bytes:
    """What a node signs to remove its own advertisement from a tracker (``DELETE /nodes/{key}?signed_at=T&sig=S``)."""
    return canonical({"key": key, "op": "deregister", "signed_at": signed_at})


__all__ = [
    "deregistration",
    "KEY_FILE",
    "IdentityError",
    "NodeIdentity",
    "canonical",
    "public_key",
    "verify",
    "verify_json",
]
