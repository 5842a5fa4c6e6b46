"""DHT discovery on loopback (issue 25): nodes announce their HTTP port under the model's key, others find them;
the DHT never uses libtorrent's public router and sends nothing without contacts."""

from __future__ import annotations

import asyncio
import time

import libtorrent as lt
import pytest

from ggufswarm.net.dht import PUBLIC_ROUTER, Discovery, dht_settings, parse_contact, swarm_key

MODEL = "ab" * 32
LOOKUP_BOUND_S = 10.0  # generous; measured ~50-300 ms on loopback (printed)


def _standalone(bootstrap: list[str]) -> Discovery:
    return Discovery.standalone("127.0.0.1", 0, bootstrap)


@pytest.fixture
def mesh():
    """A (no bootstrap) and B, C bootstrapping from A only; B announces 9101, C 9102 and 9103 (as a relay)."""
    made: list[Discovery] = []
    a = _standalone([])
    made.append(a)
    b, c = _standalone([a.contact()]), _standalone([a.contact()])
    made += [b, c]
    key = swarm_key(MODEL)
    b.announce(9101, key)
    c.announce(9102, key)
    c.announce(9103, key)
    assert b.wait_bootstrapped(5) and c.wait_bootstrapped(5)
    yield a, b, c, key, made
    for d in made:
        d.close()


def _lookup_until(d: Discovery, key, want: set, bound_s: float) -> tuple[set, float]:
    """Look up until ``want`` is found or ``bound_s`` passes (announces may still be in flight); (found, ms)."""
    t0 = time.monotonic()
    found: set = set()
    while time.monotonic() - t0 < bound_s:
        found = set(d.lookup(key, timeout_s=bound_s))
        if want <= found:
            break
        time.sleep(0.05)
    return found, (time.monotonic() - t0) * 1000


def test_lookup_finds_every_announced_port(mesh):
    a, b, c, key, made = mesh
    want = {("127.0.0.1", 9101), ("127.0.0.1", 9102), ("127.0.0.1", 9103)}
    t0 = time.monotonic()
    d = _standalone([a.contact()])
    made.append(d)
    found, ms = _lookup_until(d, key, want, LOOKUP_BOUND_S)
    total_ms = (time.monotonic() - t0) * 1000
    print(f"\nD created -> complete lookup: {total_ms:.0f} ms (lookup calls {ms:.0f} ms)")
    assert found == want  # several ports from one IP under one key are all stored (libtorrent keys by ip+port)
    t1 = time.monotonic()
    assert set(d.lookup(key)) == want
    print(f"warm lookup: {(time.monotonic() - t1) * 1000:.0f} ms")
    assert d.lookup(swarm_key("cd" * 32), timeout_s=3) == []  # another model: nothing
    assert set(asyncio.run(a.alookup(key))) == want  # the bootstrap contact itself finds them too


def test_lookup_with_a_dead_contact(mesh):
    a, b, c, key, made = mesh
    dead = _standalone([])
    dead_contact = dead.contact()
    dead.close()
    want = {("127.0.0.1", 9101), ("127.0.0.1", 9102), ("127.0.0.1", 9103)}
    t0 = time.monotonic()
    d = _standalone([dead_contact, a.contact()])
    made.append(d)
    found, ms = _lookup_until(d, key, want, LOOKUP_BOUND_S)
    print(f"\nwith a dead contact first: D created -> complete lookup {(time.monotonic() - t0) * 1000:.0f} ms")
    assert found == want


def test_stop_announcing_and_contacts_added_later(mesh):
    a, b, c, key, made = mesh
    late = _standalone([])
    made.append(late)
    other = swarm_key("ef" * 32)
    late.announce(9200, other)
    late.add_contacts([a.contact()])
    found, ms = _lookup_until(b, other, {("127.0.0.1", 9200)}, LOOKUP_BOUND_S)
    print(f"\nannounce before any contact, found after add_contacts: {ms:.0f} ms")
    assert found == {("127.0.0.1", 9200)}
    late.stop_announcing(9200)
    assert late._announced == {}


def test_no_public_router_and_silence_without_contacts():
    assert PUBLIC_ROUTER in lt.default_settings()["dht_bootstrap_nodes"]  # what we must override
    for bootstrap in ([], ["127.0.0.1:1"], ["127.0.0.1:1", "10.77.0.2:6881"]):
        for enabled in (True, False):
            s = lt.session({"listen_interfaces": "127.0.0.1:0", **dht_settings(bootstrap, enabled)})
            got = s.get_settings()
            assert got["dht_bootstrap_nodes"] == (",".join(bootstrap) if enabled else "")
            assert got["enable_dht"] is enabled and got["enable_lsd"] is False
            assert PUBLIC_ROUTER not in got["dht_bootstrap_nodes"]
    lone = _standalone([])
    try:
        assert lone.session.get_settings()["dht_bootstrap_nodes"] == ""
        assert not lone.wait_bootstrapped(1.5)
        assert lone.live_nodes == 0 and lone.messages == (0, 0)  # nothing sent, nothing received
        t0 = time.monotonic()
        assert lone.lookup(swarm_key(MODEL), timeout_s=2) == []
        assert time.monotonic() - t0 < 1  # no contacts: an empty traversal, no wait
        assert lone.messages[1] == 0
    finally:
        lone.close()


def test_wrapping_a_swarm_style_session():
    a = _standalone([])
    s = lt.session({"listen_interfaces": "127.0.0.1:0", "enable_dht": False, "alert_mask": lt.alert_category.error})
    d = Discovery(s, [a.contact()])
    try:
        assert s.get_settings()["enable_dht"] and s.get_settings()["dht_bootstrap_nodes"] == a.contact()
        assert s.get_settings()["alert_mask"] & lt.alert_category.error
        seen = []
        d.subscribe(seen.append)
        d.announce(9300, swarm_key(MODEL))
        found, _ = _lookup_until(a, swarm_key(MODEL), {("127.0.0.1", 9300)}, LOOKUP_BOUND_S)
        assert found == {("127.0.0.1", 9300)} and seen
    finally:
        d.close()
        a.close()
    assert s.is_dht_running()  # a wrapped session is left open


def test_keys_contacts_and_errors():
    assert swarm_key(MODEL).to_bytes() == __import__("hashlib").sha1(b"ggufswarm/nodes/1/" + MODEL.encode()).digest()
    assert parse_contact("10.77.0.1:6881") == ("10.77.0.1", 6881)
    assert parse_contact("[::1]:6881") == ("::1", 6881)
    for bad in ("nohost", "h:0", "h:70000", ":1", "h:x"):
        with pytest.raises(ValueError):
            parse_contact(bad)
    with pytest.raises(ValueError):
        dht_settings(["bad"])
    d = _standalone([])
    with pytest.raises(ValueError):
        d.announce(0, swarm_key(MODEL))
    with pytest.raises(TypeError):
        d.lookup(b"short")
    d.close()
    with pytest.raises(Exception, match="closed"):
        d.lookup(swarm_key(MODEL))
