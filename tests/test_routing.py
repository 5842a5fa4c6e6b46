"""Route planning over synthetic shard advertisements (no network)."""

from __future__ import annotations

import pytest

from ggufswarm.directory.routing import Advertisement, NoRoute, plan_route


def ad(node, start, end, *, ms=10.0, kv=10_000, state="ready", n=18):
    return Advertisement(
        node,
        f"http://{node}",
        "m",
        (start, end),
        embed=start == 0,
        head=end == n,
        state=state,
        free_kv_tokens=kv,
        decode_ms=ms,
    )


def ids(route):
    return [a.node_id for a in route]


def test_simple_chain():
    assert ids(plan_route([ad("a", 0, 6), ad("b", 6, 12), ad("c", 12, 18)], 18, 1024)) == ["a", "b", "c"]


def test_gap_is_named():
    with pytest.raises(NoRoute, match="layers 6:12 are not served"):
        plan_route([ad("a", 0, 6), ad("c", 12, 18)], 18, 1024)
    with pytest.raises(NoRoute, match="layers 6:9, 15:18 are not served"):
        plan_route([ad("a", 0, 6), ad("b", 9, 15)], 18, 1024)


def test_nodes_not_ready_do_not_count():
    with pytest.raises(NoRoute, match="layers 6:12"):
        plan_route([ad("a", 0, 6), ad("b", 6, 12, state="fetching"), ad("c", 12, 18)], 18, 1024)


def test_overlaps_pick_a_chain_that_lines_up():
    ads = [ad("a", 0, 9), ad("b", 6, 18), ad("c", 9, 18), ad("d", 0, 6)]
    route = plan_route(ads, 18, 1024)
    assert [a.layers for a in route] in ([(0, 9), (9, 18)], [(0, 6), (6, 18)])
    with pytest.raises(NoRoute, match="chain"):
        plan_route([ad("a", 0, 9), ad("b", 6, 18)], 18, 1024)


def test_node_without_free_kv_is_avoided():
    ads = [ad("a", 0, 6), ad("b1", 6, 12, kv=100, ms=1.0), ad("b2", 6, 12, kv=5000, ms=20.0), ad("c", 12, 18)]
    assert ids(plan_route(ads, 18, 2048)) == ["a", "b2", "c"]
    with pytest.raises(NoRoute, match="free KV"):
        plan_route(ads, 18, 8000)


def test_lower_latency_preferred():
    ads = [ad("slow", 0, 18, ms=100.0), ad("a", 0, 9, ms=20.0), ad("b", 9, 18, ms=20.0)]
    assert ids(plan_route(ads, 18, 1024)) == ["a", "b"]
    assert ids(plan_route(ads, 18, 1024, hop_ms=70.0)) == ["slow"]


def test_load_spread_over_equal_candidates():
    ads = [ad("x", 0, 18), ad("y", 0, 18)]
    assert ids(plan_route(ads, 18, 1024, load={"x": 3, "y": 1})) == ["y"]
    assert ids(plan_route(ads, 18, 1024, load={"x": 0, "y": 2})) == ["x"]


def test_a_node_that_has_not_decoded_counts_at_the_median_per_layer_time():
    """A new node advertises decode_ms 0: it is planned at the median per-layer time of the nodes that have decoded
    (here 1 ms/layer → 6 ms), so it neither takes every route (0 ms would beat any measured node) nor none."""
    ads = [ad("a", 0, 6, ms=6.0), ad("fast", 6, 12, ms=3.0), ad("new", 6, 12, ms=0.0), ad("c", 12, 18, ms=6.0)]
    assert ids(plan_route(ads, 18, 1024)) == ["a", "fast", "c"]
    ads[1] = ad("slow", 6, 12, ms=9.0)
    assert ids(plan_route(ads, 18, 1024)) == ["a", "new", "c"]
    fresh = [ad("a", 0, 6, ms=0.0), ad("b", 6, 18, ms=0.0), ad("d", 6, 18, ms=0.0)]  # none measured: load decides
    assert ids(plan_route(fresh, 18, 1024, load={"b": 1})) == ["a", "d"]


def test_measured_time_overrides_a_faster_claim():
    """A node claiming 0.01 ms that a client measured at 40 ms per step is planned at 40 ms (placement sanity)."""
    from ggufswarm.directory.routing import parse_measured

    ads = [ad("a", 0, 6, ms=6.0), ad("honest", 6, 12, ms=6.0), ad("claims", 6, 12, ms=0.01), ad("c", 12, 18, ms=6.0)]
    assert ids(plan_route(ads, 18, 1024)) == ["a", "claims", "c"]
    assert ids(plan_route(ads, 18, 1024, measured=parse_measured("claims:40.5,a:1"))) == ["a", "honest", "c"]
    for bad in ("x", "x:-1", "x:nan", ":3", "x:1e9"):
        with pytest.raises(ValueError):
            parse_measured(bad)


def test_first_needs_embedding_and_last_needs_head():
    no_head = Advertisement("c", "http://c", "m", (12, 18), head=False, free_kv_tokens=10_000)
    with pytest.raises(NoRoute):
        plan_route([ad("a", 0, 6), ad("b", 6, 12), no_head], 18, 1024)


def test_span_plans_a_replacement_for_one_hop():
    ads = [ad("a", 0, 6), ad("b", 6, 12), ad("b2", 6, 9), ad("b3", 9, 12), ad("c", 12, 18), ad("x", 3, 15)]
    assert ids(plan_route(ads, 18, 1024, span=(6, 12))) == ["b"]
    without_b = [a for a in ads if a.node_id != "b"]
    assert ids(plan_route(without_b, 18, 1024, span=(6, 12))) == ["b2", "b3"]  # two nodes may replace one
    assert ids(plan_route(ads, 18, 1024, span=(12, 18))) == ["c"]  # ends with the head
    with pytest.raises(NoRoute, match="layers 6:9 are not served"):
        plan_route([a for a in without_b if a.node_id not in ("b2", "x")], 18, 1024, span=(6, 12))
    with pytest.raises(NoRoute, match="span"):
        plan_route(ads, 18, 1024, span=(12, 6))


# -- admission from advertised accounting only (issue 12, item 3) ------------------------------------------

GiB = 2**30


def acc_ad(node, start, end, *, kv, state=0, free, sessions=4, n=61, ms=10.0, max_length=None, free_kv_tokens=0):
    """An advertisement whose capacity is only in ``extra.accounting`` (bytes); ``free_kv_tokens`` is left
    wrong on purpose (0) so a test sees the planner ignore it. No architecture name anywhere."""
    accounting = {
        "kv_bytes_per_token": kv,
        "state_bytes_per_session": state,
        "free_bytes": free,
        "free_sessions": sessions,
        "weight_bytes": 10 * GiB,
        "boundary_bytes_per_token": 7168 * 4,
        "n_embd": 7168,
    }
    if max_length is not None:
        accounting["max_length"] = max_length
    return Advertisement(
        node,
        f"http://{node}",
        "m",
        (start, end),
        embed=start == 0,
        head=end == n,
        free_kv_tokens=free_kv_tokens,
        decode_ms=ms,
        extra={"accounting": accounting},
    )


def test_mla_and_recurrent_shards_admitted_from_advertised_bytes():
    """An MLA shard (30 layers × 576-element f16 latent = 34,560 B/token) with 4.5 GiB free and a recurrent
    shard (KV 0 B/token, 64 MiB of state per session): a 128K session needs 4.22 GiB on the first, fits;
    131072 tokens is the most a session can have on the route, the recurrent shard never limits the length."""
    from ggufswarm.directory.routing import UNBOUNDED, free_kv_tokens, route_context, route_wire_bytes_per_token

    mla = acc_ad("mla", 0, 30, kv=30 * 576 * 2, free=int(4.5 * GiB))
    recurrent = acc_ad("rec", 30, 61, kv=0, state=64 * 2**20, free=256 * 2**20)
    assert free_kv_tokens(mla) == (int(4.5 * GiB)) // 34_560
    assert free_kv_tokens(recurrent) == UNBOUNDED
    route = plan_route([mla, recurrent], 61, 131072)
    assert ids(route) == ["mla", "rec"]
    assert route_context(route) == free_kv_tokens(mla) >= 131072
    assert route_wire_bytes_per_token(route) == 7168 * 4  # one hop: the head sends a token id back
    with pytest.raises(NoRoute, match="layers 0:30 has 200000 tokens of free KV"):
        plan_route([mla, recurrent], 61, 200_000)


def test_recurrent_shard_refused_when_its_state_does_not_fit():
    """A recurrent shard with less free memory than one session's state, or no free session slot, admits
    nothing, whatever the length; another replica with room is picked instead."""
    from ggufswarm.directory.routing import free_kv_tokens

    mla = acc_ad("mla", 0, 30, kv=34_560, free=8 * GiB)
    full = acc_ad("rec-full", 30, 61, kv=0, state=64 * 2**20, free=32 * 2**20, ms=1.0)
    no_slot = acc_ad("rec-busy", 30, 61, kv=0, state=64 * 2**20, free=GiB, sessions=0, ms=1.0)
    room = acc_ad("rec-room", 30, 61, kv=0, state=64 * 2**20, free=GiB, ms=50.0)
    assert free_kv_tokens(full) == 0 and free_kv_tokens(no_slot) == 0
    assert ids(plan_route([mla, full, no_slot, room], 61, 16)) == ["mla", "rec-room"]
    with pytest.raises(NoRoute, match="free KV"):
        plan_route([mla, full, no_slot], 61, 16)


def test_advertised_bytes_pick_the_replica_with_room_and_cap_at_max_length():
    """Two MLA replicas of layers 0:30: the faster one has room for 1,000 tokens only (bytes), so a 4,096-token
    session goes to the slower one; an advertised max_length caps the context whatever the bytes."""
    from ggufswarm.directory.routing import free_kv_tokens

    small = acc_ad("fast-small", 0, 30, kv=34_560, free=34_560 * 1000, ms=1.0)
    big = acc_ad("slow-big", 0, 30, kv=34_560, free=GiB, ms=30.0, max_length=8192)
    head = acc_ad("head", 30, 61, kv=1000, free=GiB)
    assert ids(plan_route([small, big, head], 61, 512)) == ["fast-small", "head"]
    assert ids(plan_route([small, big, head], 61, 4096)) == ["slow-big", "head"]
    assert free_kv_tokens(big) == 8192
    with pytest.raises(NoRoute):
        plan_route([small, big, head], 61, 8193)


def test_malformed_accounting_is_a_value_error():
    from ggufswarm.directory.routing import free_kv_tokens

    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        free_kv_tokens(acc_ad("x", 0, 61, kv=-1, free=1))
    with pytest.raises(ValueError, match="free_bytes"):
        free_kv_tokens(acc_ad("x", 0, 61, kv=1, free="lots"))
