"""Stored responses of ``/v1/responses`` (``store: true``): what ``previous_response_id`` continues and ``GET`` /
``DELETE /v1/responses/{id}`` read, in the gateway's memory, bounded in count, bytes and age, each private to the
API key that made it."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED_RESPONSES = 1024  # responses kept at most; past it the least recently used goes
MAX_STORED_BYTES = 64 * 2**20  # their JSON (response, input items, conversation) and token ids, in bytes at most
MAX_STORED_AGE_S = 24 * 3600.0  # a response is forgotten this long (s) after it was stored
TOKEN_BYTES = 4  # what one stored token id counts for


@dataclass
class StoredResponse:
    """One stored response: the ``response`` object as answered, its own ``input_items`` (each with an ``id``),
    the whole ``conversation`` a continuation starts from (the previous response's conversation, these input
    items, then the output items), and ``token_ids``: the prompt's token ids then the generated ones."""

    response: dict
    input_items: list[dict]
    conversation: list[dict]
    token_ids: list[int]
    nbytes: int
    stored_at: float


def owner_key(api_key: str | None) -> str:
    """The store's owner of a request made with ``api_key`` (its SHA-256; "" without API keys: one shared space)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class ResponseStore:
    """Stored responses by (owner, id), least recently used first. Runs on the gateway's event loop (no lock)."""

    def __init__(
        self,
        max_count: int = MAX_STORED_RESPONSES,
        max_bytes: int = MAX_STORED_BYTES,
        max_age_s: float = MAX_STORED_AGE_S,
        clock=time.monotonic,
    ):
        self.max_count, self.max_bytes, self.max_age_s, self.clock = max_count, max_bytes, max_age_s, clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, owner: str, response: dict, input_items: list[dict], conversation: list[dict], token_ids: list[int]
    ) -> bool:
        """Store ``response`` (under ``response["id"]``) for ``owner``, evicting the least recently used past the
        bounds; False (nothing stored) when it alone is over ``max_bytes``."""
        self._expire()
        text = json.dumps([response, input_items, conversation], separators=(",", ":"))
        nbytes = len(text.encode()) + TOKEN_BYTES * len(token_ids)
        if nbytes > self.max_bytes:
            return False
        key = (owner, response["id"])
        self._drop(key)
        self._entries[key] = StoredResponse(response, input_items, conversation, token_ids, nbytes, self.clock())
        self.nbytes += nbytes
        while len(self._entries) > self.max_count or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response ``response_id`` stored by ``owner`` (None: never stored, by another owner, or evicted)."""
        self._expire()
        found = self._entries.get((owner, response_id))
        if found is not None:
            self._entries.move_to_end((owner, response_id))
        return found

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget ``response_id`` of ``owner``; whether it was there."""
        self._expire()
        return self._drop((owner, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        gone = self._entries.pop(key, None)
        if gone is not None:
            self.nbytes -= gone.nbytes
        return gone is not None

    def _expire(self) -> None:
        oldest = self.clock() - self.max_age_s
        stale = [k for k, v in self._entries.items() if v.stored_at < oldest]
        for key in stale:
            self._drop(key)
