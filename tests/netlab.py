"""A throwaway test internet in network namespaces for NAT-traversal tests and benches (UPnP router, strict NAT).

Topology (every name carries a per-run prefix, e.g. ``gs1234ab-``; nothing is linked to the root namespace):

* ``pub``: the public segment, a bridge ``br0`` holding 10.77.0.1/24 (and 10.77.0.254, the STUN server's second
  address). Trackers, gateways and public nodes run here: several processes on one address, different ports.
* ``rA``: router A, WAN 10.77.0.2, LAN 192.168.77.1/24; masquerade; forward drops what comes from the WAN unless
  established or opened by miniupnpd (UPnP IGD + NAT-PMP/PCP, LAN side only), which runs here in the foreground.
* ``hA``: home A, 192.168.77.2/24 behind rA.
* ``rB``: router B, WAN 10.77.0.3, LAN 192.168.78.1/24; ``masquerade random`` (address-and-port-dependent
  mapping), forward drops new connections from the WAN; no port-mapping service.
* ``hB``: home B, 192.168.78.2/24 behind rB.
* ``add_public_host(name)``: more hosts on the public segment (10.77.0.10, .11, ...).

miniupnpd 2.3.1 refuses port forwarding on a WAN with a private address and rejects a private ``ext_ip=`` (it has
no ``ext_allow_private_ipv4``); with ``ext_perform_stun=yes`` it asks a STUN server and enables forwarding when it
finds no filtering NAT in front. So the lab runs a small RFC 5780-style STUN server on pub (10.77.0.1:3478, change
address 10.77.0.254:3479), started by running this file: ``python netlab.py stun A1 A2 P1 P2``.

Every namespace has an nft table ``netlab_guard`` whose output (and, in routers, forward) chain counts and drops
packets to any destination outside the test nets; ``NetLab.escaped_packets()`` reads those counters.
IPv6 is disabled everywhere. ``NetLab.close()`` (or leaving the ``with`` block) kills every process in the lab's
namespaces and deletes them; a later lab also removes namespaces left behind by a dead process.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PUB_NET = "10.77.0.0/24"
STUN_ADDRS = ("10.77.0.1", "10.77.0.254")
STUN_PORTS = (3478, 3479)
ALLOWED = ("127.0.0.0/8", PUB_NET, "192.168.77.0/24", "192.168.78.0/24", "239.255.255.250", "224.0.0.0/24")
ROLES = ("pub", "rA", "hA", "rB", "hB")
ADDR = {"pub": "10.77.0.1", "rA": "10.77.0.2", "hA": "192.168.77.2", "rB": "10.77.0.3", "hB": "192.168.78.2"}
LAN = {"rA": ("192.168.77.1", "192.168.77.0/24", "hA"), "rB": ("192.168.78.1", "192.168.78.0/24", "hB")}
_NAME_RE = re.compile(r"^gs(\d+)x[0-9a-f]{2}-")
_GUARD = """table inet netlab_guard {{
    counter escaped {{}}
    set allowed {{ type ipv4_addr; flags interval; elements = {{ {allowed} }}; }}
    chain output {{ type filter hook output priority -10; policy accept;
        ip daddr != @allowed counter name "escaped" drop
        meta nfproto ipv6 counter name "escaped" drop
    }}
{forward}}}
"""
_GUARD_FORWARD = """    chain forward {{ type filter hook forward priority -10; policy accept;
        ip daddr != @allowed counter name "escaped" drop
        meta nfproto ipv6 counter name "escaped" drop
    }}
"""
# router A: the chains miniupnpd-nftables 2.3.1 fills (inet family; names set in its config), around our NAT/filter
_ROUTER_A = """table inet miniupnpd {{
    chain forward {{ type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
        jump miniupnpd
    }}
    chain miniupnpd {{}}
    chain prerouting {{ type nat hook prerouting priority -100; policy accept;
        jump prerouting_miniupnpd
    }}
    chain postrouting {{ type nat hook postrouting priority 100; policy accept;
        jump postrouting_miniupnpd
        ip saddr {lan} oifname "wan" masquerade
    }}
    chain prerouting_miniupnpd {{}}
    chain postrouting_miniupnpd {{}}
}}
"""
_ROUTER_B = """table inet netlab_nat {{
    chain forward {{ type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }}
    chain postrouting {{ type nat hook postrouting priority 100; policy accept;
        ip saddr {lan} oifname "wan" masquerade random
    }}
}}
"""
_MINIUPNPD_CONF = """ext_ifname=wan
listening_ip=lan
http_port=0
enable_natpmp=yes
enable_upnp=yes
ext_perform_stun=yes
ext_stun_host={stun_host}
ext_stun_port={stun_port}
secure_mode=yes
system_uptime=yes
notify_interval=60
clean_ruleset_interval=600
lease_file={lease}
uuid={uuid}
upnp_table_name=miniupnpd
upnp_nat_table_name=miniupnpd
upnp_forward_chain=miniupnpd
upnp_nat_chain=prerouting_miniupnpd
upnp_nat_postrouting_chain=postrouting_miniupnpd
allow 1024-65535 192.168.77.0/24 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
"""


def netlab_available() -> str | None:
    """None when this machine can build a NetLab (Linux, root, ip, nft, tc, sysctl, miniupnpd), else the reason."""
    if not sys.platform.startswith("linux"):
        return f"netlab needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "netlab needs root (ip netns, nft, miniupnpd); run the netlab tests as root"
    missing = [t for t in ("ip", "nft", "tc", "sysctl", "miniupnpd") if shutil.which(t) is None]
    if missing:
        return (
            f"netlab needs {', '.join(missing)} on PATH (make test-deps installs nftables miniupnpd-nftables iproute2)"
        )
    version = subprocess.run(
        ["miniupnpd", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ).stdout
    if "nftables" not in version:
        return f"netlab needs miniupnpd's nftables build (Debian: miniupnpd-nftables), not: {version.strip()}"
    return None


def _sh(argv: list[str], timeout: float = 30, input: str | None = None, check: bool = True):
    """Run ``argv``; on failure raise RuntimeError naming the command and its stderr."""
    try:
        r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"netlab: {' '.join(argv)} timed out after {timeout}s") from e
    if check and r.returncode != 0:
        raise RuntimeError(f"netlab: {' '.join(argv)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str, grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process running in namespace ``ns``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
            time.sleep(0.02)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def cleanup_stale() -> list[str]:
    """Delete lab namespaces (and temp dirs) whose creating process is gone (a killed run); return the namespaces."""
    stale = []
    for line in _sh(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = (line.split() or [""])[0]
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns_pids(name, grace=0.5)
            _sh(["ip", "netns", "del", name], check=False)
            stale.append(name)
    for d in Path(tempfile.gettempdir()).glob("netlab-gs*"):
        m = _NAME_RE.match(d.name.removeprefix("netlab-"))
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
    return stale


class NetLab:
    """The test internet; a context manager. Setup failures raise RuntimeError (with the failing command's stderr)
    after tearing down whatever was built.

    ``ns``: role -> namespace name; ``addr``: role -> IPv4 (WAN address for routers); ``lan_addr``: router -> LAN
    address; ``tmp``: the lab's temp dir (miniupnpd's config, lease file, log); ``setup_seconds``.

    ``delay_ms`` > 0 puts a netem delay of that many ms on both directions of every access link of the public
    segment (router WANs and extra public hosts): pub <-> rA one way gains delay_ms, rA <-> rB one way 2*delay_ms.
    """

    def __init__(self, delay_ms: float = 0.0):
        self.prefix = f"gs{os.getpid()}x{secrets.token_hex(1)}-"
        self.ns: dict[str, str] = {}
        self.addr: dict[str, str] = {}
        self.lan_addr = {r: LAN[r][0] for r in LAN}
        self.tmp = Path(tempfile.mkdtemp(prefix=f"netlab-{self.prefix}"))
        self.delay_ms = 0.0
        self._procs: list[subprocess.Popen] = []
        self._links: list[tuple[str, str]] = []  # (role, dev): both ends of every access link of the public segment
        self._miniupnpd: subprocess.Popen | None = None
        self._miniupnpd_log_text = ""
        self._closed = False
        atexit.register(self.close)
        t0 = time.monotonic()
        try:
            self._setup(delay_ms)
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running things -------------------------------------------------------------------------------------------

    def cmd(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside ``role``'s namespace."""
        return ["ip", "netns", "exec", self.ns[role], *argv]

    def popen(self, role: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in ``role``'s namespace (own session); it is killed, SIGTERM then SIGKILL, at close()."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.cmd(role, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, role: str, argv: list[str], timeout: float = 60, check: bool = True, **kw):
        """Run ``argv`` in ``role``'s namespace to completion (text output captured unless told otherwise); with
        ``check`` a non-zero exit or a timeout raises RuntimeError carrying its stderr."""
        kw.setdefault("capture_output", "stdout" not in kw and "stderr" not in kw)
        kw.setdefault("text", True)
        try:
            r = subprocess.run(self.cmd(role, argv), timeout=timeout, **kw)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"netlab[{role}]: {' '.join(argv)} timed out after {timeout}s; stderr: {e.stderr}"
            ) from e
        if check and r.returncode != 0:
            raise RuntimeError(
                f"netlab[{role}]: {' '.join(argv)} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
            )
        return r

    def _ip(self, role: str, args: str) -> None:
        _sh(["ip", "-n", self.ns[role], *args.split()])

    def _nft(self, role: str, ruleset: str) -> None:
        _sh(self.cmd(role, ["nft", "-f", "-"]), input=ruleset)

    # -- building ---------------------------------------------------------------------------------------------------

    def _add_ns(self, role: str, forward: bool) -> None:
        name = self.prefix + role
        _sh(["ip", "netns", "add", name])
        self.ns[role] = name
        ipv6_off = [f"net.ipv6.conf.{c}.disable_ipv6=1" for c in ("all", "default")]
        _sh(self.cmd(role, ["sysctl", "-q", "-w", *ipv6_off, f"net.ipv4.ip_forward={int(forward)}"]))
        self._ip(role, "link set dev lo up")
        guard = _GUARD.format(allowed=", ".join(ALLOWED), forward=_GUARD_FORWARD.format() if forward else "")
        self._nft(role, guard)

    def _setup(self, delay_ms: float) -> None:
        reason = netlab_available()
        if reason:
            raise RuntimeError(reason)
        cleanup_stale()
        for role in ROLES:
            self._add_ns(role, forward=role.startswith("r"))
        self._ip("pub", "link add name br0 type bridge")
        for a in STUN_ADDRS:
            self._ip("pub", f"addr add {a}/24 dev br0")
        self._ip("pub", "link set dev br0 up")
        self._ip("pub", "route add default dev br0")  # so a stray send reaches the guard and is counted
        self.addr["pub"] = ADDR["pub"]
        for router, (lan_ip, lan_net, home) in LAN.items():
            self._attach_public(router, ADDR[router], dev="wan")
            self._ip(router, f"link add name lan type veth peer name eth0 netns {self.ns[home]}")
            self._ip(router, f"addr add {lan_ip}/24 dev lan")
            self._ip(router, "link set dev lan up")
            self._ip(home, f"addr add {ADDR[home]}/24 dev eth0")
            self._ip(home, "link set dev eth0 up")
            self._ip(home, f"route add default via {lan_ip}")
            self.addr[home] = ADDR[home]
            self._nft(router, (_ROUTER_A if router == "rA" else _ROUTER_B).format(lan=lan_net))
        if delay_ms > 0:
            self.set_delay(delay_ms)
        self._start_stun()
        self._start_miniupnpd()

    def _attach_public(self, role: str, ip: str, dev: str) -> None:
        """Link ``role``'s namespace to pub's bridge by a veth (``dev`` on its side) and give it ``ip``."""
        port = f"v{role}"[:15]
        self._ip("pub", f"link add name {port} type veth peer name {dev} netns {self.ns[role]}")
        self._ip("pub", f"link set dev {port} master br0 up")
        self._ip(role, f"addr add {ip}/24 dev {dev}")
        self._ip(role, f"link set dev {dev} up")
        self._ip(role, f"route add default via {ADDR['pub']}")
        self.addr[role] = ip
        self._links += [("pub", port), (role, dev)]
        if self.delay_ms > 0:
            for r, d in self._links[-2:]:
                self._netem(r, d, self.delay_ms)

    def add_public_host(self, name: str) -> str:
        """Another host on the public segment (namespace role ``name``, address 10.77.0.10 and up); returns its IPv4."""
        if name in self.ns or not re.fullmatch(r"[A-Za-z0-9_]{1,12}", name):
            raise ValueError(f"netlab: bad or duplicate public host name {name!r}")
        n = 10 + sum(1 for r in self.ns if r not in ROLES)
        if n > 250:
            raise ValueError("netlab: too many public hosts")
        self._add_ns(name, forward=False)
        self._attach_public(name, f"10.77.0.{n}", dev="eth0")
        return self.addr[name]

    def _start_stun(self) -> None:
        argv = [sys.executable, "-u", str(Path(__file__).resolve()), "stun", *STUN_ADDRS, *map(str, STUN_PORTS)]
        p = self.popen("pub", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = p.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"netlab: the STUN server on pub did not start: {line}{p.stdout.read()}")

    def _start_miniupnpd(self) -> None:
        conf = self.tmp / "miniupnpd.conf"
        conf.write_text(
            _MINIUPNPD_CONF.format(
                stun_host=STUN_ADDRS[0],
                stun_port=STUN_PORTS[0],
                lease=self.tmp / "miniupnpd.leases",
                uuid="3d3cec3a-8cf0-11e0-98ee-001a6bd2" + secrets.token_hex(2),
            )
        )
        self._log_path = self.tmp / "miniupnpd.log"
        with open(self._log_path, "w") as log:
            argv = ["miniupnpd", "-d", "-f", str(conf), "-P", str(self.tmp / "miniupnpd.pid")]
            self._miniupnpd = self.popen("rA", argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        want = ("Port forwarding is now enabled", "Listening for NAT-PMP", "HTTP listening on port")
        while True:
            text = self.miniupnpd_log()
            if all(w in text for w in want):
                return
            if self._miniupnpd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"netlab: miniupnpd in rA did not come up (exit {self._miniupnpd.poll()}):\n{text}")
            time.sleep(0.02)

    def miniupnpd_log(self) -> str:
        """miniupnpd's stdout+stderr so far (kept after close())."""
        path = getattr(self, "_log_path", None)
        if path is not None and path.exists():
            self._miniupnpd_log_text = path.read_text(errors="replace")
        return self._miniupnpd_log_text

    @property
    def miniupnpd_pid(self) -> int | None:
        """The pid of miniupnpd in rA (None before it started)."""
        return self._miniupnpd.pid if self._miniupnpd else None

    # -- shaping and accounting -----------------------------------------------------------------------------------

    def _netem(self, role: str, dev: str, ms: float) -> None:
        if ms > 0:
            r = _sh(["tc", "-n", self.ns[role], "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{ms}ms"],
                    check=False)  # fmt: skip
            if r.returncode != 0:
                raise RuntimeError(
                    f"netlab: cannot add a netem delay ({r.stderr.strip()}); this kernel lacks sch_netem "
                    "(CONFIG_NET_SCH_NETEM); use delay_ms=0 here"
                )
        else:
            _sh(["tc", "-n", self.ns[role], "qdisc", "del", "dev", dev, "root"], check=False)

    def set_delay(self, ms: float) -> None:
        """Set (ms > 0) or remove (ms == 0) the netem delay on both ends of every public-segment access link."""
        for role, dev in self._links:
            self._netem(role, dev, ms)
        self.delay_ms = float(ms)

    def escaped_packets(self) -> dict[str, int]:
        """Per namespace role: packets dropped because their destination was outside the test nets (all 0 = good)."""
        out = {}
        for role in self.ns:
            r = _sh(self.cmd(role, ["nft", "-j", "list", "counter", "inet", "netlab_guard", "escaped"]))
            out[role] = sum(o["counter"]["packets"] for o in json.loads(r.stdout)["nftables"] if "counter" in o)
        return out

    # -- teardown ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process of the lab (tracked or found in its namespaces) and delete its namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    p.terminate()
        deadline = time.monotonic() + 3
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        self.miniupnpd_log()
        errors = []
        for name in self.ns.values():
            _kill_netns_pids(name)
            r = _sh(["ip", "netns", "del", name], check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                errors.append(f"{name}: {r.stderr.strip()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        if errors:
            raise RuntimeError("netlab: teardown failed: " + "; ".join(errors))


# -- the STUN server (run in pub by NetLab) -------------------------------------------------------------------------

_COOKIE = 0x2112A442


def _stun_addr_attr(kind: int, ip: str, port: int, xor: bool = False) -> bytes:
    raw_ip = struct.unpack("!I", socket.inet_aton(ip))[0]
    if xor:
        port, raw_ip = port ^ (_COOKIE >> 16), raw_ip ^ _COOKIE
    return struct.pack("!HHBBHI", kind, 8, 0, 1, port, raw_ip)


def stun_serve(addrs: tuple[str, str], ports: tuple[int, int]) -> None:
    """Answer STUN Binding Requests on the four (address, port) pairs, honouring CHANGE-REQUEST (RFC 3489/5780)."""
    import select

    socks = {}
    for ai, a in enumerate(addrs):
        for pi, p in enumerate(ports):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((a, p))
            socks[(ai, pi)] = s
    print("ready", flush=True)
    by_fd = {s.fileno(): key for key, s in socks.items()}
    while True:
        for s in select.select(list(socks.values()), [], [])[0]:
            data, peer = s.recvfrom(2048)
            if len(data) < 20 or data[:2] != b"\x00\x01":
                continue
            ai, pi = by_fd[s.fileno()]
            off = 20
            while off + 4 <= len(data):  # find CHANGE-REQUEST
                kind, length = struct.unpack("!HH", data[off : off + 4])
                if kind == 0x0003 and length >= 4:
                    flags = data[off + 7]
                    ai, pi = ai ^ bool(flags & 4), pi ^ bool(flags & 2)
                off += 4 + (length + 3) // 4 * 4
            out = socks[(ai, pi)]
            other = (addrs[1 - by_fd[s.fileno()][0]], ports[1 - by_fd[s.fileno()][1]])
            attrs = (
                _stun_addr_attr(0x0001, *peer)
                + _stun_addr_attr(0x0020, *peer, xor=True)
                + _stun_addr_attr(0x802B, addrs[ai], ports[pi])
                + _stun_addr_attr(0x802C, *other)
            )
            out.sendto(struct.pack("!HH", 0x0101, len(attrs)) + data[4:20] + attrs, peer)


def stun_request(sock: socket.socket, server: tuple[str, int], timeout: float = 2.0) -> tuple[str, int]:
    """Send one STUN Binding Request from ``sock`` to ``server``; return the (address, port) it saw us come from."""
    tid = secrets.token_bytes(12)
    sock.settimeout(timeout)
    sock.sendto(struct.pack("!HHI", 0x0001, 0, _COOKIE) + tid, server)
    while True:
        data, _ = sock.recvfrom(2048)
        if data[8:20] == tid and data[:2] == b"\x01\x01":
            break
    off = 20
    while off + 4 <= len(data):
        kind, length = struct.unpack("!HH", data[off : off + 4])
        if kind == 0x0001:
            _, _, port, raw = struct.unpack("!BBHI", data[off + 4 : off + 12])
            return socket.inet_ntoa(struct.pack("!I", raw)), port
        off += 4 + length
    raise RuntimeError("STUN response without MAPPED-ADDRESS")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "stun":
        stun_serve((sys.argv[2], sys.argv[3]), (int(sys.argv[4]), int(sys.argv[5])))
    else:
        sys.exit("usage: netlab.py stun ADDR1 ADDR2 PORT1 PORT2")
