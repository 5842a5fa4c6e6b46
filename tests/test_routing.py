"""Route planning over synthetic shard advertisements (no network)."""

from __future__ import annotations

import pytest

from ggufswarm.tracker.routing import Advertisement, NoRoute, plan_route


def ad(node, start, end, *, ms=10.0, kv=10_000, state="ready", n=18):
    return Advertisement(node, f"http://{node}", "m", (start, end), embed=start == 0, head=end == n,
                         state=state, free_kv_tokens=kv, decode_ms=ms)


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
