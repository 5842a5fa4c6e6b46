"""Port mapping on a home router through libtorrent's UPnP IGD and NAT-PMP/PCP clients (``add_port_mapping``).

libtorrent finds the router (UPnP: SSDP on the home LAN; NAT-PMP: the default gateway) and keeps the mappings
renewed while its session lives; this module asks it for one TCP port and waits for the router's answer
(``portmap_alert`` / ``portmap_error_alert``, seen through the session's one alert pump, ``net.dht.Discovery``).
"""

from __future__ import annotations

import threading
import time

import libtorrent as lt

TRANSPORTS = {0: "natpmp", 1: "upnp"}  # lt.portmap_transport values


class PortMapper:
    """Maps TCP ports of ``session`` (an ``lt.session``) on the home router. ``subscribe(callback)``: how it sees
    the session's alerts (``Discovery.subscribe``). libtorrent's UPnP and NAT-PMP clients are switched on by the
    first ``map`` only (they multicast an SSDP search on the LAN and ask the default gateway): a node that a
    dial-back already reached never sends either. Thread-safe."""

    def __init__(self, session, subscribe):
        self.session = session
        self._cond = threading.Condition()
        self._mapped: dict[int, tuple[int, str]] = {}  # mapping index -> (external port, transport)
        self._failed: dict[int, str] = {}  # mapping index -> the router's or libtorrent's reason
        session.apply_settings(
            {"alert_mask": int(session.get_settings().get("alert_mask", 0)) | int(lt.alert_category.port_mapping)}
        )
        subscribe(self._on_alert)

    def _on_alert(self, alert) -> None:
        if isinstance(alert, lt.portmap_alert):
            with self._cond:
                self._mapped[alert.mapping] = (int(alert.external_port), TRANSPORTS.get(int(alert.map_transport), "?"))
                self._cond.notify_all()
        elif isinstance(alert, lt.portmap_error_alert):
            with self._cond:
                self._failed[alert.mapping] = alert.message()
                self._cond.notify_all()

    def map(self, port: int, timeout_s: float = 10.0) -> tuple[int, str] | None:
        """Ask the router to forward its TCP port ``port`` (the same number outside) to ``port`` here; ``(external
        port, "upnp" | "natpmp")`` once a router maps it, None when none does within ``timeout_s`` seconds (no
        UPnP / NAT-PMP router, or every one refused). Blocking."""
        self.session.apply_settings({"enable_upnp": True, "enable_natpmp": True})  # also maps the listen port
        indices = self.session.add_port_mapping(lt.portmap_protocol.tcp, int(port), int(port))
        indices = list(indices) if isinstance(indices, (list, tuple)) else [indices]
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i in indices:
                    if i in self._mapped:
                        return self._mapped[i]
                if all(i in self._failed for i in indices):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def reasons(self) -> list[str]:
        """What libtorrent or the routers said about mappings that failed."""
        with self._cond:
            return list(self._failed.values())


__all__ = ["PortMapper"]
