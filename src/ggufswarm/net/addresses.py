"""Where a part of the swarm listens: the local address that faces the machines it was told of, and the one-line
warning for a part that listens on loopback while those machines are elsewhere.

A tracker, publisher, node or gateway is told of other machines by URL or contact (``--tracker URL``, ``--cache URL``,
a join link's ``dht=HOST:PORT``). A part that must be dialled by them listens, by default, on the address this
machine sends from towards them (its route's source address: no packet is sent to find it), so one command line
works on one machine (loopback) and across machines alike.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")


def _host_port(target: str) -> tuple[str, int]:
    """``(host, port)`` of a URL (``http://HOST:PORT/...``) or a contact (``HOST:PORT``, ``[V6]:PORT``)."""
    if "://" in target:
        parts = urlsplit(target)
        default = 443 if parts.scheme == "https" else 80
        return parts.hostname or "", parts.port or default
    host, _, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port) if port.isdigit() else 80


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` spells, in any form a resolver takes (``127.1``, ``0x7f000001``, ``2130706433``), an
    IPv4-mapped IPv6 address as its IPv4 one; None for a name (nothing is resolved)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))  # (a name that is not a number raises)
        except OSError:
            return None
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


def is_loopback(host: str | None) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 in any spelling (``ip_of``); a name is resolved: one that
    resolves only to loopback is."""
    if not host:
        return False
    if host == "localhost":
        return True
    ip = ip_of(host)
    if ip is not None:
        return ip.is_loopback
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def source_address(target: str) -> str | None:
    """The local address this machine sends from to ``target`` (a URL or ``HOST:PORT``), found by connecting a UDP
    socket (no packet is sent); None when ``target`` has no host, cannot be resolved or has no route."""
    host, port = _host_port(target)
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _type, _proto, _name, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(addr)
            except OSError:
                continue
            return probe.getsockname()[0]
    return None


def listen_host_toward(targets) -> str | None:
    """Where a part told of ``targets`` (URLs or ``HOST:PORT`` contacts; None entries skipped) listens by default:
    the address it sends from to the first target on another machine, else 127.0.0.1 when every target is on this
    one; None when there is no target (the caller keeps its own default)."""
    targets = [t for t in targets if t]
    for target in targets:
        if not is_loopback(_host_port(target)[0]):
            found = source_address(target)
            if found:
                return found
    return LOOPBACK if targets else None


def loopback_warning(part: str, listen: str | None, targets, flag: str = "--host") -> str | None:
    """One line saying that ``part`` (e.g. ``"ggufswarm node"``) listens (or is advertised) at ``listen``, a
    loopback address, while a target it was told of is on another machine, which then cannot reach it; the line
    names ``flag``. None when nothing is wrong."""
    if not is_loopback(listen):
        return None
    remote = next((t for t in targets if t and not is_loopback(_host_port(t)[0])), None)
    if remote is None:
        return None
    return (
        f"{part}: WARNING: {flag} {listen} is loopback-only, but {remote} is on another machine: no other machine "
        f"can reach it (drop {flag} to use the address {remote} is reached from, or give {flag} ADDR)"
    )


__all__ = ["LOOPBACK", "WILDCARDS", "ip_of", "is_loopback", "listen_host_toward", "loopback_warning", "source_address"]
