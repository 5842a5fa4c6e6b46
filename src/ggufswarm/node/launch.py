"""Start node processes on free loopback ports (for ``ggufswarm demo``, tests and benchmarks)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ..net.auth import TOKEN_ENV
from ..runtime.spec import ShardSpec


@dataclass
class NodeProcess:
    """A running ``ggufswarm node`` child: its URL, shard and process."""

    url: str
    spec: ShardSpec
    proc: subprocess.Popen

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; waits for the exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL now (a crash, as far as the route can tell)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def node_command(
    spec: ShardSpec, model: str | None = None, port: int = 0, threads: int | None = None, extra: list[str] | None = None
) -> list[str]:
    """The argv of a ``ggufswarm node`` serving ``spec`` (run with this Python)."""
    cmd = [
        sys.executable,
        "-m",
        "ggufswarm.cli",
        "node",
        "--layers",
        f"{spec.start}:{spec.end}",
        "--port",
        str(port),
        "--exit-with-parent",
    ]
    if spec.embed:
        cmd.append("--embed")
    if spec.head:
        cmd.append("--head")
    if model:
        cmd += ["--model", str(model)]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + list(extra or [])


def start_nodes(
    specs: list[ShardSpec],
    model: str | None = None,
    threads: int | None = None,
    extra: list[str] | None = None,
    timeout: float = 120.0,
    stderr=None,
    per_node=None,
    token: str | None = None,
    per_node_env=None,
) -> list[NodeProcess]:
    """Start one node per spec (in parallel) and wait for each one's ready line.

    ``per_node(i) -> list[str]``: extra arguments for node ``i`` only (e.g. its own data directory);
    ``per_node_env(i) -> dict``: environment variables for node ``i`` only (e.g. ``GGML_VK_VISIBLE_DEVICES``).
    ``token``: the swarm token, given to the node commands in their environment (``$GGUFSWARM_TOKEN``, which the
    command line reads: not on their command line, where any local user could read it); otherwise they inherit
    this process's environment as it is.

    Raises RuntimeError (after stopping the others) when a node exits or is not ready within ``timeout`` s.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if token:
        env[TOKEN_ENV] = token
    nodes, lines = [], queue.Queue()
    for i, spec in enumerate(specs):
        args = list(extra or []) + (per_node(i) if per_node else [])
        proc = subprocess.Popen(
            node_command(spec, model, 0, threads, args),
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env | (per_node_env(i) if per_node_env else {}),
        )
        nodes.append(NodeProcess("", spec, proc))

        def pump(i=i, proc=proc):
            for line in proc.stdout:
                if line.startswith("ggufswarm node ready: "):
                    lines.put((i, line.split()[3]))
            lines.put((i, None))

        threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    pending = set(range(len(specs)))
    try:
        while pending:
            try:
                i, url = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"nodes {sorted(pending)} not ready within {timeout:g} s") from None
            if url is None:
                if i in pending:
                    raise RuntimeError(
                        f"node {specs[i].start}:{specs[i].end} exited with status "
                        f"{nodes[i].proc.wait()} before it was ready"
                    )
                continue
            nodes[i].url = url
            pending.discard(i)
    except BaseException:
        stop_nodes(nodes)
        raise
    return nodes


def stop_nodes(nodes: list[NodeProcess], timeout: float = 10.0) -> None:
    """Stop every node (SIGTERM to all first, then wait, then SIGKILL stragglers)."""
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for n in nodes:
        try:
            n.proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            n.proc.kill()
            n.proc.wait()
