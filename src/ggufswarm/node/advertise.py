"""A node and its tracker: the shard advertisement (free KV, decode time, the shard's accounting in bytes), the
heartbeat loop that sends it, deregistering at shutdown, and the check that a next hop is a node the tracker lists.

Every call goes through ``directory.trackers.TrackerClient`` (``NodeState.tracker``) on the node's own aiohttp session.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from ..directory.lookup import DirectoryError
from ..directory.trackers import TrackerError
from ..protocol import ProtocolError
from .lies import parse_lie
from .numerics import numerics
from .state import NodeState
from .step_path import F32_BYTES

READVERTISE_S = 0.2  # after a change of free KV, at most this long (s) before the tracker hears of it; batches a burst
PEERS_TTL_S = 5.0  # how long (s) the tracker's list of this model's nodes is trusted for the next_hop check
HEARTBEATS_PER_TTL = 3  # beats within the tracker's TTL of an advertisement
LISTEN_POLL_S = 0.05  # the heartbeat loop's wait for the server to listen (s)
ACCOUNTING_KEYS = ("weight_bytes", "state_bytes_per_session", "boundary_bytes_per_token", "n_embd")
HOP_KEYS = (
    "n_embd",
    "n_layers",
    "max_length",
    "max_step_tokens",
    "model_fingerprint",
    "model_name",
    "max_verify_tokens",
)


def shard_accounting(state: NodeState) -> dict:
    """``extra.accounting`` of the advertisement: this shard's numbers, from its GGUF header
    (``artifact.accounting``) and its session store; the tracker plans with these alone.

    ``kv_bytes_per_token`` (the executor's: f16 llama.cpp cache, or the torch backend's dtype; 0 for
    recurrent layers), ``state_bytes_per_session``, ``weight_bytes``, ``boundary_bytes_per_token`` (f32
    frames), ``n_embd``; ``free_bytes``: KV/state bytes of the node's budget not reserved by open sessions
    (``(budget - reserved tokens) * kv_bytes_per_token + free slots * state_bytes_per_session``);
    ``free_sessions``: session slots left (None: not limited); ``max_length``: the longest session it opens.
    """
    static = state.accounting
    if static is None:
        from ..artifact.accounting import shard_account

        try:
            acc = shard_account(
                state.executor.model, state.spec.start, state.spec.end, state.spec.embed, state.spec.head
            ).to_json()
        except (AttributeError, KeyError, ValueError):  # an executor without a GGUF header (a test double)
            acc = {
                "weight_bytes": 0,
                "state_bytes_per_session": 0,
                "n_embd": state.cfg.n_embd,
                "boundary_bytes_per_token": 0 if state.spec.head else F32_BYTES * state.path.n_embd_out,
            }
        static = state.accounting = {k: acc[k] for k in ACCOUNTING_KEYS}
    store = state.store
    per_token = store.kv_bytes_per_token()
    slots = state.executor.n_seq_max
    free_sessions = None if slots is None else max(slots - len(store.sessions), 0)
    free_state = (free_sessions if free_sessions is not None else 1) * static["state_bytes_per_session"]
    return {
        **static,
        "kv_bytes_per_token": per_token,
        "free_bytes": store.free_tokens() * per_token + free_state,
        "free_sessions": free_sessions,
        "max_length": state.max_session_tokens,
    }


def advertisement(state: NodeState) -> dict:
    """This node's shard advertisement for the tracker (free KV in tokens, mean decode compute in ms, the
    shard's accounting in bytes: ``shard_accounting``, its numerics fingerprint: node/numerics.py), signed with
    the node's key (``node_id`` is its public key, ``sig`` the ed25519 signature of the rest, ``signed_at`` unix
    seconds: net/identity.py)."""
    h = state.health()
    ad = {
        "node_id": state.node_id,
        "url": state.url,
        "model": state.config.swarm_name or state.config.model,
        "layers": [state.spec.start, state.spec.end],
        "embed": state.spec.embed,
        "head": state.spec.head,
        "state": "ready",
        "free_kv_tokens": state.store.free_tokens(),
        "decode_ms": round(_claimed_ms(state), 3),
        # what a client needs to use this node in a route (client.route.Hop), so it need not ask /health
        "extra": {
            "hop": {k: h[k] for k in HOP_KEYS} | {"cache": bool(h["cache"])},
            "accounting": shard_accounting(state),
            # how to reach it: direct, through a mapped port of its home router, or through a relay (node/reach.py)
            "reach": state.reach.to_json() if state.reach is not None else {"path": "direct"},
            # what decides the bits of this shard's outputs: a client replays its steps where this is equal
            "numerics": numerics(state),
            # the device its blocks run on (llama.cpp; runtime/llamacpp/devices.py Placement): the planner's view
            "placement": h["placement"],
        },
        "signed_at": round(time.time(), 3),
    }
    return state.identity.sign_json(ad)


def _claimed_ms(state: NodeState) -> float:
    """The decode time (ms) advertised: the node's mean (``NodeState.decode_ms``), or a ``--test-lie slow`` node's
    false claim (testing only)."""
    lie = parse_lie(state.config.test_lie) if state.config.test_lie else None
    claimed = lie.claimed_decode_ms if lie is not None else None
    return state.decode_ms() if claimed is None else claimed


BANNED_POLL_S = 1.0  # how often (s) a banned node checks whether its last session has ended


async def heartbeats(state: NodeState) -> None:
    """Advertise to every tracker of the swarm once listening, then every ``heartbeat_s`` seconds (at most a third
    of the shortest TTL a tracker returns), and within ``READVERTISE_S`` of sessions opening, closing or expiring
    (``NodeState.readvertise``): trackers plan from the free KV advertised. Tracker errors are reported once per
    tracker (and again after it answered), never fatal."""
    interval, warned = state.config.heartbeat_s, set()
    state.capacity_changed = changed = asyncio.Event()
    while not state.url:  # advertise as soon as we listen
        await asyncio.sleep(LISTEN_POLL_S)

    async def beat(tracker) -> float | None:
        try:
            body = await tracker.aheartbeat(state.client, advertisement(state))
        except TrackerError as exc:
            if exc.status == 403 and "banned" in exc.reason:  # no tracker or gateway will route to this key again
                if not state.banned:
                    state.banned = banned_message(state, exc.reason)
                    print(f"ggufswarm node: {state.banned}", file=sys.stderr, flush=True)
                    asyncio.get_running_loop().create_task(_stop_when_idle(state))
                return None
            if exc.status == 400 and not state.refused:  # what it advertises is wrong: it can never be listed
                state.refused = f"the tracker {tracker.url} refuses this node's advertisement ({exc.reason}); stopping"
                print(f"ggufswarm node: {state.refused}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return None
            return warn(tracker, exc)
        except (TypeError, ValueError) as exc:
            return warn(tracker, exc)
        warned.discard(tracker.url)
        return float(body["ttl_s"]) if isinstance(body, dict) and body.get("ttl_s") else None

    def warn(tracker, exc: Exception) -> None:
        if tracker.url not in warned:
            reason = str(exc) or type(exc).__name__
            print(f"ggufswarm node: tracker heartbeat failed ({reason}); still serving", file=sys.stderr)
        warned.add(tracker.url)
        return None

    while True:
        ttls = [t for t in await asyncio.gather(*(beat(t) for t in state.trackers)) if t]
        if ttls:
            interval = min(state.config.heartbeat_s, min(ttls) / HEARTBEATS_PER_TTL)
        try:
            await asyncio.wait_for(changed.wait(), interval)
            await asyncio.sleep(READVERTISE_S)  # the rest of a burst of opens / closes goes in the same beat
        except TimeoutError:
            pass
        changed.clear()


def banned_message(state: NodeState, reason: str) -> str:
    """What a node whose key the swarm banned says before it stops (``run_node`` exits with it)."""
    key = state.identity.path
    tracker = state.trackers[0].url if state.trackers else "URL"
    return (
        f"this node's key is banned from the swarm ({reason}): the tracker took signed evidence that a node holding "
        f"it returned outputs two other nodes of its numerics contradict, and no route will use it again; it stops "
        f"once the sessions it holds have ended (at most --session-ttl). The evidence is public: 'ggufswarm bans "
        f"--tracker {tracker} --json'; if this node is honest, show it to the swarm's operator, who can "
        f"lift the ban (then start it again). The key is {key or 'in --data-dir'}: nodes started in one --data-dir "
        "take its keys in start order (identity.key, identity-1.key, ...), so a node started where a banned one ran "
        "may take its key; give each node its own --data-dir"
    )


async def _stop_when_idle(state: NodeState) -> None:
    """SIGTERM this process once it holds no session (a banned node: gateways repair its sessions away first)."""
    while state.store.sessions or state.path.active_sessions:
        await asyncio.sleep(BANNED_POLL_S)
    print("ggufswarm node: banned and idle; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


async def deregister(state: NodeState) -> None:
    """Remove this node from every tracker (at shutdown); a tracker that does not answer is ignored."""

    async def one(tracker) -> None:
        try:
            await tracker.aderegister(state.client, state.identity)
        except TrackerError:
            pass

    await asyncio.gather(*(one(t) for t in state.trackers))


async def check_registered(state: NodeState, url: str | None, what: str = "next_hop") -> None:
    """With a tracker or the DHT, a next_hop (or ``what`` else a node sends frames to: a ring's first node) must be a
    node they list for this node's model (the list is cached for ``PEERS_TTL_S`` and fetched again on a miss), and
    prove it holds the key listed for that address before this node sends it the swarm token (a signed challenge,
    net.reach.Proven: an advertisement names any address it likes). ProtocolError next_hop_unknown (403) or
    tracker_unavailable (503)."""
    if url is None or (state.tracker is None and state.directory is None):
        return
    now = time.monotonic()
    model = state.config.swarm_name or state.config.model or ""
    if url not in state.peers or now - state.peers_at >= PEERS_TTL_S:
        try:
            if state.directory is not None:  # its trackers, then the DHT (a tracker that is down is not needed)
                listed = await state.directory.nodes(state.client)
            else:
                listed = await state.tracker.anodes(state.client, model)
            state.peers = {str(n["url"]).rstrip("/"): str(n.get("node_id")) for n in listed}
            state.peers_at = now
        except (TrackerError, DirectoryError, KeyError, TypeError) as exc:
            raise ProtocolError(
                "tracker_unavailable", f"cannot check {what} {url} with the tracker: {type(exc).__name__}"
            ) from None
    if url not in state.peers:
        raise ProtocolError(
            "next_hop_unknown", f"{what} {url} is not a node the tracker lists for model {model!r}; refused"
        )
    why = await state.proven.check(url, state.peers[url])
    if why is not None:
        raise ProtocolError("next_hop_unknown", f"{what} {url} is not the node listed there ({why}); refused")


__all__ = ["READVERTISE_S", "advertisement", "check_registered", "deregister", "heartbeats", "shard_accounting"]
