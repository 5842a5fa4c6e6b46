"""Smoke tests of the namespace test internet (tests/netlab.py): UPnP/NAT-PMP through miniupnpd, strict NAT, no leaks.

Run with ``make netlab`` (root, nftables, miniupnpd-nftables, iproute2); without them these tests fail with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netlab import NetLab, netlab_available

pytestmark = pytest.mark.netlab

TESTS = str(Path(__file__).parent)
PY = sys.executable

# libtorrent in a home: map ext_port -> local_port by UPnP and/or NAT-PMP, print the alerts as JSON, then hold the
# mapping until stdin closes (libtorrent deletes its mappings when the session ends)
PORTMAP = r"""
import json, sys, time
import libtorrent as lt
listen, ext, local, wait = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
upnp, natpmp = sys.argv[5] in ("both", "upnp"), sys.argv[5] in ("both", "natpmp")
s = lt.session({"enable_upnp": upnp, "enable_natpmp": natpmp, "enable_dht": False, "enable_lsd": False,
                "dht_bootstrap_nodes": "", "listen_interfaces": f"0.0.0.0:{listen}",
                "alert_mask": lt.alert_category.port_mapping | lt.alert_category.port_mapping_log
                | lt.alert_category.error})
t0 = time.monotonic()
ours = [int(m) for m in s.add_port_mapping(lt.portmap_protocol.tcp, ext, local)]
events, log, deadline = [], [], t0 + wait
while time.monotonic() < deadline:
    s.wait_for_alert(100)
    for a in s.pop_alerts():
        t = round(time.monotonic() - t0, 3)
        if isinstance(a, lt.portmap_alert) and int(a.mapping) in ours:
            events.append({"kind": "map", "port": a.external_port, "transport": a.map_transport.name, "t": t})
            deadline = min(deadline, time.monotonic() + 1.5)  # give the other transport a moment
        elif isinstance(a, lt.portmap_error_alert) and int(a.mapping) in ours:
            events.append({"kind": "error", "transport": a.map_transport.name, "msg": a.message(), "t": t})
        elif isinstance(a, lt.portmap_log_alert):
            log.append(a.message())
print(json.dumps({"events": events, "log": log[-30:]}), flush=True)
sys.stdin.read()
"""

# TCP connect + HTTP GET; prints the status or the error's class
FETCH = r"""
import sys, urllib.request
try:
    print(urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/", timeout=float(sys.argv[3])).status)
except OSError as e:
    print(type(getattr(e, "reason", e)).__name__)
"""

# STUN from one local socket to two server ports: the mapped (address, port) each saw
STUN = r"""
import json, socket, sys
sys.path.insert(0, sys.argv[1])
from netlab import STUN_ADDRS, STUN_PORTS, stun_request
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 0))
print(json.dumps([s.getsockname()[1]] + [stun_request(s, (STUN_ADDRS[0], p)) for p in STUN_PORTS]))
"""


@pytest.fixture(scope="module")
def lab():
    """One lab for the module (built once, ~1 s)."""
    reason = netlab_available()
    if reason:
        pytest.fail(reason)
    with NetLab() as lab:
        yield lab


def http_server(lab: NetLab, role: str, port: int) -> subprocess.Popen:
    """``python -m http.server`` in ``role``, returned once it listens; its access log is on stderr."""
    p = lab.popen(role, [PY, "-u", "-m", "http.server", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline().decode()
    assert "Serving HTTP" in line, line + p.stderr.read().decode()
    return p


def fetch(lab: NetLab, role: str, host: str, port: int, timeout: float = 3.0) -> str:
    return lab.run(role, [PY, "-c", FETCH, host, str(port), str(timeout)], timeout=timeout + 10).stdout.strip()


def portmap(lab: NetLab, role: str, listen: int, ext: int, local: int, wait: float, transports: str = "both"):
    """libtorrent in ``role`` asking for ext -> local: (its process, holding the mapping until stdin closes; result)."""
    argv = [PY, "-c", PORTMAP, *map(str, (listen, ext, local, wait)), transports]
    p = lab.popen(role, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"portmap script failed: {p.stderr.read()}")
    return p, json.loads(line)


def release(p: subprocess.Popen) -> None:
    """End a portmap script (libtorrent removes its mappings on the way out)."""
    p.stdin.close()
    p.wait(timeout=15)


def stop(p: subprocess.Popen) -> str:
    """Stop a server started by http_server; return its access log."""
    p.terminate()
    return p.communicate(timeout=5)[1].decode()


@pytest.mark.parametrize("transports,ext", [("both", 18000), ("upnp", 18001), ("natpmp", 18002)])
def test_mapping_through_router_a(lab, transports, ext):
    """libtorrent in hA maps ext -> hA:8000 on router A by UPnP/NAT-PMP; pub then reaches hA's server there."""
    server = http_server(lab, "hA", 8000)
    t0 = time.monotonic()
    holder, result = portmap(lab, "hA", listen=6881, ext=ext, local=8000, wait=10, transports=transports)
    took = time.monotonic() - t0
    maps = [e for e in result["events"] if e["kind"] == "map"]
    try:
        assert maps, f"no portmap_alert: {result}\nminiupnpd:\n{lab.miniupnpd_log()[-3000:]}"
        first = maps[0]
        print(
            f"\n{transports}: first mapping by {first['transport']} after {first['t']} s (script {took:.1f} s): {maps}"
        )
        assert first["port"] == ext and (transports == "both" or first["transport"] == transports)
        assert fetch(lab, "pub", lab.addr["rA"], ext) == "200"
    finally:
        release(holder)
    assert fetch(lab, "pub", lab.addr["rA"], ext, timeout=2) != "200"  # libtorrent removed the mapping on exit
    log = stop(server)
    assert f"{lab.addr['pub']} - -" in log, log  # DNAT keeps the public peer's address
    assert set(lab.escaped_packets().values()) == {0}


def test_router_b_is_strict_nat(lab):
    pub_server = http_server(lab, "pub", 8080)
    home_server = http_server(lab, "hB", 8000)
    assert fetch(lab, "hB", lab.addr["pub"], 8080) == "200"  # outbound through the NAT
    assert f"{lab.addr['rB']} - -" in stop(pub_server)  # seen from the public side as router B's WAN address
    assert fetch(lab, "pub", lab.addr["rB"], 8000, timeout=2) in ("ConnectionRefusedError", "TimeoutError")
    holder, result = portmap(lab, "hB", listen=6881, ext=18000, local=8000, wait=4)
    release(holder)
    assert not [e for e in result["events"] if e["kind"] == "map"], result
    print(f"\nhB port mapping: {result['events'] or 'nothing within 4 s'}")
    assert "GET" not in stop(home_server)  # nothing from outside ever reached hB's server
    assert set(lab.escaped_packets().values()) == {0}


def test_nat_mapping_behaviour(lab):
    """rB's masquerade random maps one socket to a new port per destination; rA's keeps one mapping."""
    local_b, (ip_b1, port_b1), (ip_b2, port_b2) = json.loads(lab.run("hB", [PY, "-c", STUN, TESTS]).stdout)
    assert ip_b1 == ip_b2 == lab.addr["rB"]
    assert port_b1 != port_b2, "router B should map one socket to different ports per destination"
    local_a, (ip_a1, port_a1), (ip_a2, port_a2) = json.loads(lab.run("hA", [PY, "-c", STUN, TESTS]).stdout)
    assert ip_a1 == ip_a2 == lab.addr["rA"] and port_a1 == port_a2


def test_nothing_escapes(lab):
    # a mix of traffic of all kinds between every pair that can talk, then the guards' counters
    server = http_server(lab, "pub", 8081)
    for role in ("hA", "hB", "rA", "rB"):
        assert fetch(lab, role, lab.addr["pub"], 8081) == "200"
    stop(server)
    for role in ("hA", "hB"):
        lab.run(role, [PY, "-c", STUN, TESTS])
    assert lab.escaped_packets() == {role: 0 for role in lab.ns}


def test_set_delay(lab):
    try:
        lab.set_delay(50)
    except RuntimeError as e:  # a kernel without sch_netem (CONFIG_NET_SCH_NETEM) says so clearly
        assert "netem" in str(e)
        lab.set_delay(0)
        return
    try:
        t0 = time.monotonic()
        lab.run("hA", [PY, "-c", STUN, TESTS])  # two round trips hA -> pub: 2 x 2 x 50 ms at least
        assert time.monotonic() - t0 >= 0.2
    finally:
        lab.set_delay(0)


def test_teardown_and_guard_counts():
    """A second lab: extra public host, the guards count a stray packet, and close() leaves nothing behind."""
    reason = netlab_available()
    if reason:
        pytest.fail(reason)
    lab = NetLab()
    try:
        ip = lab.add_public_host("x1")
        local, (seen_ip, _), _ = json.loads(lab.run("x1", [PY, "-c", STUN, TESTS]).stdout)
        assert seen_ip == ip == "10.77.0.10"
        send = "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('192.0.2.1', 9))"
        lab.run("hA", [PY, "-c", send], check=False)
        lab.run("pub", [PY, "-c", send.replace("192.0.2.1", "198.51.100.1")], check=False)
        escaped = lab.escaped_packets()
        assert escaped["hA"] >= 1 and escaped["pub"] >= 1, escaped
        names, pid = set(lab.ns.values()), lab.miniupnpd_pid
        assert pid and Path(f"/proc/{pid}").exists()
    finally:
        t0 = time.monotonic()
        lab.close()
    print(f"\nsetup {lab.setup_seconds:.2f} s, close {time.monotonic() - t0:.2f} s")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not names & {line.split()[0] for line in listed.splitlines() if line.strip()}
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "shutting down MiniUPnPd" in lab.miniupnpd_log()
