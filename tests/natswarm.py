"""Processes of a swarm in the namespace test internet (tests/netlab.py), shared by tests/test_nat_swarm.py and
bench/bench_nat.py: a process with its ready lines (``Proc``), a node's ready line (``node_ready``), and the start of
a swarm: tracker + publisher on pub and the join link that names them (``start_published``)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ggufswarm.net.invite import JoinLink

PY = sys.executable
CLI = [PY, "-m", "ggufswarm.cli"]
PUB = "10.77.0.1"
CLIENT = str(Path(__file__).with_name("nat_client.py"))


class Proc:
    """A process in the lab (``lab.popen``) with the swarm token (and ``env``) in its environment, run in ``cwd``
    (default ``tmp``), its stdout lines queued and its stderr kept in ``tmp/NAME.err``, each line stamped with
    seconds since the start."""

    def __init__(
        self, lab, role: str, argv: list[str], name: str, tmp: Path, token: str, env: dict | None = None, cwd=None
    ):
        self.name, self.err_path, self.t0 = name, tmp / f"{name}.err", time.monotonic()
        self.lines: queue.Queue = queue.Queue()
        env = dict(os.environ, GGUFSWARM_TOKEN=token, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = lab.popen(
            role, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd or tmp
        )
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        with open(self.err_path, "w") as err:
            for line in self.proc.stderr:
                err.write(f"[{time.monotonic() - self.t0:7.2f}] {line}")
                err.flush()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first stdout line matching ``pattern`` (regex) within ``timeout`` s. RuntimeError with the stderr
        tail when none comes or the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(
                    f"{self.name}: no line matching {pattern!r} in {timeout:g} s\n{self.stderr()}"
                ) from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}) before {pattern!r}\n{self.stderr()}")
            m = re.search(pattern, line)
            if m:
                return m

    def stderr(self, tail: int = 4000) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        """Send ``sig`` and wait (SIGKILL after ``timeout`` s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL now (a crash, as far as the swarm can tell)."""
        self.stop(signal.SIGKILL)


def node_ready(p: Proc, timeout: float = 240) -> tuple[str, str]:
    """(URL, reach path) of a node's ready line."""
    m = p.wait_for(r"ggufswarm node ready: (\S+) .*?(?:reach (\w+))?$", timeout)
    return m.group(1).rstrip("/"), m.group(2) or "direct"


def start_published(start, tmp: Path, model_path, token: str, tracker_port: int, relay_port: int) -> str:
    """Start a tracker and a publisher of ``model_path`` on pub (``start(name, role, argv) -> Proc``); the join link
    naming them, the DHT contact ``PUB:6881`` (the node to start with ``--torrent-port 6881``), the relay at
    ``PUB:relay_port`` and ``token``."""
    tracker = f"http://{PUB}:{tracker_port}"
    db = str(tmp / "t.db")
    t = start("tracker", "pub", [*CLI, "tracker", "--host", "0.0.0.0", "--port", str(tracker_port), "--db", db])
    t.wait_for(r"ggufswarm tracker ready", 60)
    pub = start(
        "publisher",
        "pub",
        [*CLI, "publish", str(model_path), "--tracker", tracker, "--data-dir", str(tmp / "pub"), "--host", "0.0.0.0"],
    )
    published = JoinLink.parse(pub.wait_for(r"(ggufswarm://join\S+)", 120).group(1))
    return JoinLink(
        published.model,
        published.model_id,
        dht=(f"{PUB}:6881",),
        trackers=published.trackers,
        relays=(f"http://{PUB}:{relay_port}",),
        secret=token,
    ).format()
