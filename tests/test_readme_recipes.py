"""README.md's multi-machine recipes, run line by line as written, one network namespace per machine
(tests/netlab.py): "A network by hand" on a flat LAN, and "Joining across home networks" with the home node behind
a NAT that maps no port (router B: a strict NAT). Each ends in a greedy completion, asked with the official
``openai`` client, equal to llama.cpp's own on this machine.

The lines are parsed from README.md, so an edit that breaks a recipe fails here. Each is run by bash as a user would
type it (the ``ggufswarm`` of this checkout on PATH, ``$GGUFSWARM_TOKEN`` and ``$LINK`` set as the README says),
with its placeholders filled in: HOST (the address of the machine a line's comment calls HOST), KEY (an API key).
Where a line runs: on HOST when its comment says "on HOST", behind router B when it says "at home", else on a
machine of its own on the public segment; each machine has its own working directory.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from natswarm import PY, Proc
from netlab import NetLab, netlab_available

from ggufswarm.client.local import LocalModel

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

README = Path(__file__).parents[1] / "README.md"
BIN = str(Path(sys.executable).parent)  # this checkout's ggufswarm console script
PATH = {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin"}  # ggufswarm first; ip, nft (the lab) after
KEY = "readme-test-key"
PROMPT = "The lighthouse keeper climbed the spiral stairs at dusk and"
MAX_TOKENS = 24
READY = {  # what a service prints on stdout once it serves (a one-shot command has none)
    "tracker": r"ggufswarm tracker ready",
    "cache": r"ggufswarm cache ready",
    "publish": r"join link \(.*\): (ggufswarm://join\S+)",
    "node": r"ggufswarm node ready: ",
    "join": r"ggufswarm node ready: ",
    "gateway": r"ggufswarm gateway ready",
}


@dataclass
class Line:
    """One command of a recipe: ``text`` as README.md writes it, ``comment`` (after ``#``), ``where`` it runs
    (``"HOST"``, ``"home"`` or ``"own"``: a machine of its own)."""

    text: str
    comment: str

    @property
    def where(self) -> str:
        if "on HOST" in self.comment:
            return "HOST"
        return "home" if "at home" in self.comment else "own"

    @property
    def command(self) -> str:
        """The ggufswarm subcommand (``tracker``, ``node``, ...), or ``export`` for the token line."""
        words = self.text.split()
        return words[1] if words[0] == "ggufswarm" else words[0]


def recipe(heading: str) -> list[Line]:
    """The commands of the first ``sh`` block after ``heading`` in README.md (comment lines skipped)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("```sh\n", text.index(heading)) + len("```sh\n")
    block = text[start : text.index("```", start)]
    lines = []
    for raw in block.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        command, *comment = re.split(r"\s+#\s", raw, maxsplit=1)
        lines.append(Line(command.strip(), "".join(comment).strip()))
    assert lines, f"README.md: no commands under {heading!r}"
    return lines


@pytest.fixture(scope="module")
def reference_text(gemma_path) -> str:
    """llama.cpp's greedy completion of PROMPT on this machine, with the nodes' default thread count (all cores):
    in-process, whole model."""
    from ggufswarm.client.generate import GenerationStats, generate
    from ggufswarm.runtime.sampling import SamplingParams

    model = LocalModel.load(gemma_path, max_length=4096)
    ids = model.prompt_ids(PROMPT)
    session = model.session(len(ids) + MAX_TOKENS, SamplingParams(temperature=0))
    return "".join(generate(session, model.tokenizer, ids, MAX_TOKENS, [], GenerationStats()))


class Machines:
    """The recipe's machines in a NetLab: HOST and one per other line on the public segment, ``home`` behind router
    B; each with a working directory under ``tmp``; runs README lines there."""

    def __init__(self, lab: NetLab, tmp: Path):
        self.lab, self.tmp = lab, tmp
        self.host_ip = lab.add_public_host("HOST")
        self.procs: list[Proc] = []
        self.env = dict(PATH)
        self.token = ""

    def machine_for(self, i: int, line: Line) -> str:
        """The namespace role line ``i`` runs in (made on first use)."""
        if line.where != "own":
            return "HOST" if line.where == "HOST" else "hB"
        if f"m{i}" not in self.lab.ns:
            self.lab.add_public_host(f"m{i}")
        return f"m{i}"

    def filled(self, line: Line) -> str:
        """The line with HOST and KEY filled in (``$LINK`` and ``$GGUFSWARM_TOKEN`` are bash's to expand)."""
        return re.sub(r"\bKEY\b", KEY, re.sub(r"\bHOST\b", self.host_ip, line.text))

    def token_for(self, line: Line) -> str:
        """The swarm token in a line's environment: the exported one, except where a line joins by ``$LINK`` (the
        link carries the secret; nothing else reaches that machine)."""
        return "" if "$LINK" in line.text else self.token

    def start(self, i: int, line: Line) -> tuple[str, Proc]:
        role = self.machine_for(i, line)
        cwd = self.tmp / role
        cwd.mkdir(exist_ok=True)
        proc = Proc(
            self.lab, role, ["bash", "-c", "exec " + self.filled(line)], f"{i}-{line.command}-{role}", self.tmp,
            self.token_for(line), env=self.env, cwd=cwd,
        )  # fmt: skip
        self.procs.append(proc)
        return role, proc

    def run(self, i: int, line: Line, timeout: float = 120) -> subprocess.CompletedProcess:
        role = self.machine_for(i, line)
        cwd = self.tmp / role
        cwd.mkdir(exist_ok=True)
        env = {**self.env, "GGUFSWARM_TOKEN": self.token_for(line)}
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", self.filled(line)]
        return self.lab.run(role, argv, timeout=timeout, cwd=cwd)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()


def follow(lab: NetLab, tmp: Path, lines: list[Line]) -> dict:
    """Run ``lines`` in order, each service waited for until it says it serves; what a test needs afterwards:
    ``machines``, ``gateway`` (its line and machine), ``status`` (the status line's output), ``nodes`` (URLs),
    ``model`` (the published name), ``stderr`` (every service's stderr, joined)."""
    m = Machines(lab, tmp)
    out: dict = {"machines": m, "nodes": [], "status": None}
    try:
        for i, line in enumerate(lines):
            if line.command == "export":  # the swarm token: made once, the same on every machine
                m.token = m.lab.run("HOST", ["bash", "-c", f'{line.text}; printf %s "$GGUFSWARM_TOKEN"']).stdout
                assert re.fullmatch(r"[0-9a-f]{32}", m.token), m.token
                continue
            if line.command == "status":
                out["status"] = m.run(i, line)
                continue
            role, proc = m.start(i, line)
            got = proc.wait_for(READY[line.command], 300)
            if line.command == "publish":
                m.env["LINK"] = got.group(1)
                out["model"] = shlex.split(line.text)[shlex.split(line.text).index("--name") + 1]
            elif line.command in ("node", "join"):
                url, path = re.search(r"ready: (\S+) .*?(?:reach (\w+))?$", got.string).groups()
                out["nodes"].append(url.rstrip("/"))
                out.setdefault("paths", {})[role] = path or "direct"
            elif line.command == "gateway":
                out["gateway"] = (line, role)
        out["stderr"] = "\n".join(f"--- {p.name}\n{p.stderr()}" for p in m.procs)
        return out
    except BaseException:
        for p in m.procs:
            print(f"--- {p.name}\n{p.stderr()}")
        m.close()
        raise


def ask_gateway(lab: NetLab, machines: Machines, gateway: tuple[Line, str], model: str) -> dict:
    """A greedy completion through the gateway with the official openai client: from the gateway's own machine at
    localhost when it listens on loopback (the default), else from HOST at the gateway machine's address."""
    line, role = gateway
    words = shlex.split(line.text)
    port = int(words[words.index("--port") + 1]) if "--port" in words else 8000
    everywhere = "--host" in words and words[words.index("--host") + 1] == "0.0.0.0"
    client, address = ("HOST", lab.addr[role]) if everywhere else (role, "127.0.0.1")
    code = (
        "import json, sys\nfrom openai import OpenAI\n"
        "c = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=300)\n"
        "r = c.completions.create(model=sys.argv[3], prompt=sys.argv[4], max_tokens=int(sys.argv[5]), temperature=0)\n"
        "print(json.dumps({'text': r.choices[0].text, 'telemetry': (r.model_extra or {}).get('telemetry')}))\n"
    )
    url = f"http://{address}:{port}/v1"
    r = lab.run(client, [PY, "-c", code, url, KEY, model, PROMPT, str(MAX_TOKENS)], timeout=360)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def lab():
    reason = netlab_available()
    if reason:
        pytest.fail(f"the namespace test internet is not available here: {reason}")
    with NetLab() as lab:
        yield lab


def test_a_network_by_hand_on_a_lan(lab, tmp_path, reference_text):
    """'A network by hand', each line on its own machine of one LAN (the tracker and the cache on HOST): the nodes
    fetch their layers from the publisher and each other across machines, the status line lists them, and the
    gateway's answer equals llama.cpp's."""
    lines = recipe("A network by hand")
    assert [ln.command for ln in lines].count("node") >= 2
    done = follow(lab, tmp_path, lines)
    try:
        assert all(not u.startswith("http://127.") for u in done["nodes"]), done["nodes"]
        status = done["status"]
        assert status is not None and status.returncode == 0, status
        for url in done["nodes"]:
            assert url in status.stdout, status.stdout
        answer = ask_gateway(lab, done["machines"], done["gateway"], done["model"])
        assert answer["text"] == reference_text
        hops = [h["node"] for h in answer["telemetry"]["route"]]
        assert hops and all(h in done["nodes"] for h in hops), (hops, done["nodes"])
        assert "WARNING" not in done["stderr"] and "fetch stalled" not in done["stderr"], done["stderr"]
        assert lab.escaped_packets() == dict.fromkeys(lab.ns, 0)
    finally:
        done["machines"].close()


def test_joining_across_home_networks(lab, tmp_path, reference_text):
    """'Joining across home networks': the tracker and the first node on HOST, the publisher, the last node and the
    gateway on machines of their own, the middle node at home behind a NAT that maps no port (reached through the
    tracker's relay); the answer, from another machine through the gateway, equals llama.cpp's."""
    lines = recipe("## Joining across home networks")
    assert any(ln.where == "home" for ln in lines)
    done = follow(lab, tmp_path, lines)
    try:
        assert done["paths"]["hB"] == "relayed", done["paths"]  # the strict NAT maps nothing: the tracker relays it
        home = next(p for p in done["machines"].procs if p.name.endswith("-hB"))
        answer = ask_gateway(lab, done["machines"], done["gateway"], done["model"])
        assert answer["text"] == reference_text
        hops = answer["telemetry"]["hops"]
        assert "relayed" in [h["path"] for h in hops], hops  # the route goes through the home node, relayed
        assert home.proc.poll() is None
        assert lab.escaped_packets() == dict.fromkeys(lab.ns, 0)
    finally:
        done["machines"].close()


def test_a_part_left_on_loopback_says_so_and_a_stalled_fetch_names_who_holds_the_layers(lab, tmp_path):
    """The mistakes the recipes used to invite, each said in one line: a publisher told to seed on loopback while its
    tracker is on another machine warns at start (naming --host), and a node on a third machine whose layers only
    that publisher holds says, when its fetch stalls, which layers no peer it reached holds and that the only seed
    the tracker lists is loopback-only; a node and a relaying tracker left on loopback warn the same way."""
    host, other = lab.add_public_host("HOST"), lab.add_public_host("N")
    lab.add_public_host("N2")
    tracker = f"http://{host}:8470"
    procs = []

    def start(role: str, *argv: str) -> Proc:
        proc = Proc(lab, role, ["ggufswarm", *argv], f"{len(procs)}-{argv[0]}-{role}", tmp_path, "tok", PATH)
        procs.append(proc)
        return proc

    def stderr_line(proc: Proc, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, proc.stderr())):
            assert time.monotonic() < deadline and proc.proc.poll() is None, (pattern, proc.stderr())
            time.sleep(0.2)
        return found.group(0)

    try:
        start("HOST", "tracker", "--host", "0.0.0.0", "--db", str(tmp_path / "t.db")).wait_for("ready", 60)
        pub = start("HOST", "publish", "--tracker", tracker, "--name", "gemma", "--host", "127.0.0.1",
                    "--data-dir", str(tmp_path / "pub"))  # fmt: skip
        assert "--host 127.0.0.1 is loopback-only" in stderr_line(pub, r".*WARNING.*")
        info_hash = pub.wait_for(r"info-hash ([0-9a-f]{40})", 120).group(1)
        pub.wait_for("join link", 60)
        fetcher = start("N", "node", "--tracker", tracker, "--model", "gemma", "--layers", "6:12",
                        "--fetch-stall", "3", "--data-dir", str(tmp_path / "n"))  # fmt: skip
        stalled = stderr_line(fetcher, r"fetch stalled.*")
        assert "No peer it reached holds layers 6:12" in stalled, stalled
        assert re.search(r"seed 127\.0\.0\.1:\d+ \(loopback-only\)", stalled), stalled
        assert "restart it without --host 127.0.0.1" in stalled, stalled
        # the tracker lists that seed (GET /peers) but never hands a loopback peer to a peer on another machine
        assert "127.0.0.1" not in announced_peers(lab, "N", tracker, info_hash, "tok")
        node = start("N2", "node", "--tracker", tracker, "--model", "gemma", "--layers", "0:6", "--embed",
                     "--host", "127.0.0.1", "--data-dir", str(tmp_path / "n2"))  # fmt: skip
        said = stderr_line(node, r".*WARNING.*")
        assert f"--host 127.0.0.1 is loopback-only, but {tracker} is on another machine" in said, said
        relay = start("N", "tracker", "--relay", "--public-host", other, "--db", str(tmp_path / "t2.db"))
        said = stderr_line(relay, r".*WARNING.*")
        assert "--host 127.0.0.1 is loopback-only" in said and "--host 0.0.0.0" in said, said
    finally:
        for proc in procs:
            proc.kill()


def announced_peers(lab: NetLab, role: str, tracker: str, info_hash: str, token: str) -> list[str]:
    """The peer addresses a BitTorrent announce from ``role`` gets back from ``tracker``."""
    code = (
        "import sys, urllib.parse as p, urllib.request as u, libtorrent as lt, socket\n"
        "from ggufswarm.net.auth import announce_key\n"
        "q = {'info_hash': bytes.fromhex(sys.argv[2]), 'peer_id': b'-XX0000-' + b'0' * 12, 'port': 6999, 'left': 1,\n"
        "     'swarm_key': announce_key(sys.argv[3])}\n"
        "body = lt.bdecode(u.urlopen(sys.argv[1] + '/announce?' + p.urlencode(q), timeout=10).read())\n"
        "raw = body[b'peers']\n"
        "print(' '.join(socket.inet_ntoa(raw[i : i + 4]) for i in range(0, len(raw), 6)))\n"
    )
    return lab.run(role, [PY, "-c", code, tracker, info_hash, token], timeout=60).stdout.split()
