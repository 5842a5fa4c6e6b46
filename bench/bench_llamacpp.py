"""Benchmark of the llama.cpp shard backend against llama.cpp itself: one markdown table from one run.

Model: the embedded default (Gemma 3 270M Q4_K_M). Every process runs --threads threads (default 1).
Rows (prefill: one prompt of --prefill tokens; decode: --decode greedy tokens after it):

1. llama.cpp in-process through llama-cpp-python (``llama_cpp.Llama``, n_ctx 2048, n_batch 2048, n_ubatch 512,
   flash attention): the reference every ratio is taken against.
2. ``llama-bench -fa 1`` on the whole model, and llama.cpp RPC: ``llama-bench --rpc`` over three local
   ``rpc-server -t 1`` processes, ``-ngl 99 -ts 6/6/7`` (blocks 0-5 / 6-11 / 12-17 + output, the route's
   cut; the token embedding stays in the llama-bench process). Only when the binaries exist under
   .cache/llamacpp-tools/0.3.36/bin (``make llamacpp-tools``, built without AMX like the wheel).
3. ``generate`` in-process on the llama.cpp backend: 1 shard, and 3 chained shards (split 6,12).
4. ``generate`` in-process on the torch backend (1 shard, float32).
5. The route (``ggufswarm node`` processes on loopback, ``even_split(18, n)``, f32 frames (the default), node defaults:
   --ctx-size 8192, --max-sessions 4) with 1, 2 and 3 llama.cpp nodes, and 3 torch nodes; for each node
   its RSS after the run next to the file bytes of what it serves.

Columns: prefill and decode tok/s, their ratios to row 1, and RSS MiB / shard MiB per node. Each engine is
warmed up by an untimed generation of the same prompt (4 tokens) before it is timed; each row's raw numbers are
printed as it ends.

Targets (the issue): in-process decode >= 0.95x llama.cpp; 3-node route decode >= 0.85x llama.cpp
single-process at 1 thread and >= 1.0x llama.cpp RPC with 3 servers; prefill >= 0.9x llama.cpp.

Usage:
    .venv/bin/python bench/bench_llamacpp.py [--threads 1] [--prefill 512] [--decode 64] [--quick]
    (make bench-llamacpp; --quick = --prefill 64 --decode 8, a smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.local import LocalModel
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import ShardSpec, even_split

ROOT = Path(__file__).resolve().parent.parent
TOOLS_BIN = ROOT / ".cache" / "llamacpp-tools" / "0.3.36" / "bin"
TEXT = (ROOT / "tests" / "data" / "gpl-3.0-excerpt.txt").read_text(encoding="utf-8")
GREEDY = SamplingParams(temperature=0)
MIB = 1024 * 1024
N_LAYERS = 18  # Gemma 3 270M
RPC_SPLIT = "6/6/7"  # 19 units (18 blocks + output) -> blocks 0-5, 6-11, 12-17 + output: the 3-node route's cut
NODE_CTX, NODE_SESSIONS = 8192, 4  # ggufswarm node defaults (--ctx-size, --max-sessions)


def say(msg: str) -> None:
    print(msg, flush=True)


def dump_json(res: dict, args) -> None:
    """``--json FILE`` of a bench script: ``res`` with the script's arguments under ``"args"``, as JSON to FILE
    (``-``: stdout)."""
    res["args"] = vars(args)
    text = json.dumps(res, indent=1, default=str)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def prompt_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * 4)
    while len(ids) < n:
        ids += ids[1:]
    return ids[:n]


# -- shard bytes ---------------------------------------------------------------------------------------
def shard_bytes(f: GGUFModelFile, spec: ShardSpec, embed_in_shard: bool = True) -> int:
    """GGUF bytes of what a shard serves: its blk.N.* tensors, + token_embd.weight on the first shard
    (``embed_in_shard``), + output.weight (or, tied, token_embd.weight again) and output_norm.weight on the head."""
    total = f.layer_tensor_bytes(spec.start, spec.end)
    if spec.embed and embed_in_shard:
        total += f.tensors["token_embd.weight"].n_bytes
    if spec.head:
        out = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
        total += out.n_bytes + f.tensors["output_norm.weight"].n_bytes
    return total


# -- timing --------------------------------------------------------------------------------------------
def run_session(session, ids: list[int], n_decode: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation on a RouteSession."""
    t0 = time.perf_counter()
    token = session.step(ids)
    t1 = time.perf_counter()
    for _ in range(n_decode):
        token = session.step([token])
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n_decode / (t2 - t1)


class LlamaSession:
    """llama.cpp in-process (llama-cpp-python) as a RouteSession: greedy on the last position's logits. The
    reference of every ratio: n_batch 2048, n_ubatch 512, flash attention. ``reset()`` empties its context."""

    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp
        import numpy as np

        self._lib, self._np = llama_cpp, np
        self.llm = llama_cpp.Llama(
            path,
            n_ctx=max(2048, n_ctx),
            n_batch=2048,
            n_ubatch=512,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> LlamaSession:
        self.llm.reset()  # n_tokens = 0: the next eval drops the KV cells
        return self

    def step(self, tokens: list[int]) -> int:
        self.llm.eval(tokens)
        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self._np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.llm.close()


def bench_interleaved(path: str, ids: list[int], n_decode: int, threads: int, rounds: int) -> dict[str, dict]:
    """In one process, llama.cpp and the llama.cpp backend (1 shard, 3 shards) timed in turn ``rounds`` times:
    the median prefill / decode tok/s of each. Alternating cancels the drift of a shared machine, which moves a
    single run by +-15% here."""
    import statistics

    ref = LlamaSession(path, len(ids) + n_decode + 16, threads)
    engines = {
        "llama.cpp": None,
        "backend, 1 shard": LocalModel.load(path, backend="llama.cpp", threads=threads, max_length=2048),
        "backend, 3 shards": LocalModel.load(
            path, split=[6, 12], backend="llama.cpp", threads=threads, max_length=2048
        ),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for r in range(rounds + 1):  # round 0 warms every engine up with the timed shapes
        for name, model in engines.items():
            session = ref.reset() if model is None else model.session(len(ids) + n_decode + 8, GREEDY)
            result = run_session(session, ids, n_decode)
            if model is not None:
                session.close()
            if r:
                times[name].append(result)
    ref.close()
    return {
        name: {"prefill": statistics.median(t[0] for t in ts), "decode": statistics.median(t[1] for t in ts)}
        for name, ts in times.items()
    }


def bench_llama_cpp_python(path: str, ids: list[int], n_decode: int, threads: int) -> dict:
    ref = LlamaSession(path, len(ids) + n_decode + 16, threads)
    run_session(ref.reset(), ids, 4)  # warm-up: the same shapes as the timed run (buffers allocated, pages faulted in)
    prefill, decode = run_session(ref.reset(), ids, n_decode)
    ref.close()
    gc.collect()
    return {"prefill": prefill, "decode": decode}


def bench_local(path: str, ids: list[int], n_decode: int, threads: int, backend: str, split: list[int] | None) -> dict:
    model = LocalModel.load(
        path, split=split, backend=backend, threads=threads, max_length=max(2048, len(ids) + n_decode + 16)
    )
    try:
        warm = model.session(len(ids) + 16, GREEDY)
        run_session(warm, ids, 4)
        warm.close()
        session = model.session(len(ids) + n_decode + 8, GREEDY)
        prefill, decode = run_session(session, ids, n_decode)
        session.close()
    finally:
        for shard in model.shards:
            if hasattr(shard, "close"):
                shard.close()
        del model
        gc.collect()
    return {"prefill": prefill, "decode": decode}


def bench_route(f: GGUFModelFile, n_nodes: int, ids: list[int], n_decode: int, threads: int, backend: str) -> dict:
    specs = even_split(N_LAYERS, n_nodes)
    extra = [] if backend == "llama.cpp" else ["--backend", backend]
    need = len(ids) + n_decode + 8
    if backend == "llama.cpp" and need > NODE_CTX:
        extra += ["--ctx-size", str(need)]
    with tempfile.NamedTemporaryFile("w+", prefix="bench-nodes-", suffix=".log") as log:
        try:
            nodes = start_nodes(specs, str(f.path), threads=threads, extra=extra, stderr=log)
        except Exception:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
        try:
            route = RemoteRoute([n.url for n in nodes], 120.0)
            warm = route.open(len(ids) + 16, GREEDY)
            run_session(warm, ids, 4)
            warm.close()
            session = route.open(need, GREEDY)
            prefill, decode = run_session(session, ids, n_decode)
            hops = session.telemetry.summary(route)["hops"]
            session.close()
            rss = [psutil.Process(n.proc.pid).memory_info().rss for n in nodes]
        except Exception:
            log.flush()
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
        finally:
            stop_nodes(nodes)
    mem = [(r, shard_bytes(f, s)) for r, s in zip(rss, specs)]
    # mean decode step: wall time at the client vs the nodes' own compute time (the rest is HTTP, framing, waits)
    compute = [h["compute_ms"]["mean"] for h in hops]
    return {
        "prefill": prefill,
        "decode": decode,
        "mem": mem,
        "steps": f"decode step {1e3 / decode:.1f} ms wall, node compute {' + '.join(f'{c:.1f}' for c in compute)} ms",
    }


# -- llama.cpp tools -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_bench(path: str, args: list[str], env: dict, reps: int, depth: int = 0) -> tuple[dict, str]:
    """Run llama-bench (JSON); returns ({'prefill', 'decode'} tok/s, its stderr). Prefill is its pp test
    from an empty context; decode its tg test after ``depth`` tokens (pass ``-d 0,depth`` in ``args``)."""
    cmd = [str(TOOLS_BIN / "llama-bench"), "-m", path, *args, "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        sig = f" (signal {-r.returncode})" if r.returncode < 0 else ""
        raise RuntimeError(f"llama-bench exited with {r.returncode}{sig}: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    out = {}
    for entry in json.loads(r.stdout):
        if entry["n_prompt"] and not entry["n_gen"] and not entry.get("n_depth"):
            out["prefill"] = entry["avg_ts"]
        elif entry["n_gen"] and not entry["n_prompt"] and entry.get("n_depth", 0) == depth:
            out["decode"] = entry["avg_ts"]
    return out, r.stderr


def rpc_layout(stderr: str) -> str:
    """Which device llama.cpp put each layer on, from llama-bench -v's load_tensors lines
    ("layer N assigned to device RPCk"; layer n_layer is the output layer), and its buffer sizes."""
    by_dev: dict[str, list[int]] = {}
    buffers = []
    for line in stderr.splitlines():
        m = re.match(r"load_tensors: layer +(\d+) assigned to device (\S+?),", line)
        if m:
            by_dev.setdefault(m.group(2), []).append(int(m.group(1)))
        elif line.startswith("load_tensors:") and ("buffer size" in line or "offloaded" in line):
            buffers.append(" ".join(line.split(":", 1)[1].split()))
    spans = []
    for dev, layers in by_dev.items():
        blocks = [i for i in layers if i < N_LAYERS]
        spans.append(f"{dev}: blocks {min(blocks)}-{max(blocks)}" if blocks else f"{dev}:")
        if N_LAYERS in layers:
            spans[-1] += " + output"
    return "; ".join(spans) + (f" ({'; '.join(buffers)})" if buffers else "")


@contextlib.contextmanager
def rpc_servers(threads: int, env: dict, n: int = 3):
    """``n`` local ``rpc-server -t threads`` processes; yields their ``host:port`` list. Stopped on exit."""
    servers, ports = [], []
    try:
        for _ in range(n):
            port = free_port()
            servers.append(
                subprocess.Popen(
                    [str(TOOLS_BIN / "rpc-server"), "-t", str(threads), "-H", "127.0.0.1", "-p", str(port)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
            )
            ports.append(port)
        deadline = time.monotonic() + 30
        for port, proc in zip(ports, servers):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"rpc-server on port {port} exited with {proc.returncode}")
                try:
                    socket.create_connection(("127.0.0.1", port), 0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"rpc-server on port {port} not listening within 30 s") from None
                    time.sleep(0.1)
        yield servers, [f"127.0.0.1:{p}" for p in ports]
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.terminate()
        for proc in servers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rpc_bench_args(threads: int, addrs: list[str]) -> list[str]:
    """llama-bench flags of the RPC rows: every layer on the rpc-servers, cut as the 3-node route."""
    return ["-t", str(threads), "-fa", "1", "--rpc", ",".join(addrs), "-ngl", "99", "-ts", RPC_SPLIT]


@contextlib.contextmanager
def peak_rss(servers: list[subprocess.Popen]):
    """Sample each process's RSS every 50 ms while the block runs; yields the list of peaks (bytes), final on exit."""
    peak, done = [0] * len(servers), threading.Event()
    procs = [psutil.Process(p.pid) for p in servers]

    def sample():
        while not done.is_set():
            for i, p in enumerate(procs):
                try:
                    peak[i] = max(peak[i], p.memory_info().rss)
                except psutil.Error:
                    pass
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def bench_rpc(f: GGUFModelFile, n_prefill: int, n_decode: int, threads: int, env: dict, reps: int) -> dict:
    """llama-bench over 3 rpc-server processes; peak RSS of each server while it runs."""
    with rpc_servers(threads, env) as (servers, addrs):
        with peak_rss(servers) as peak:
            out, err = llama_bench(
                str(f.path),
                [
                    "-p",
                    str(n_prefill),
                    "-n",
                    str(n_decode),
                    "-d",
                    f"0,{n_prefill}",
                    *rpc_bench_args(threads, addrs),
                    "-v",
                ],
                env,
                reps,
                n_prefill,
            )
        out["layout"] = rpc_layout(err)
        specs = [ShardSpec(0, 6, embed=True), ShardSpec(6, 12), ShardSpec(12, 18, head=True)]
        out["mem"] = [(r, shard_bytes(f, s, embed_in_shard=False)) for r, s in zip(peak, specs)]
        return out


def bench_route_interleaved(
    f: GGUFModelFile, ids: list[int], n_decode: int, threads: int, rounds: int, env: dict | None
) -> dict[str, dict]:
    """The 3-node route, llama.cpp in-process and (with ``env``: the tools are built) llama.cpp RPC over 3
    rpc-servers, all started once and timed in turn for ``rounds`` rounds after an untimed warm-up round.

    Returns per engine the median prefill / decode tok/s, and for the route the median of its per-round
    ratios to each other engine (``"ratio_<engine>"``): a ratio taken inside one round compares runs seconds
    apart, so the drift of a shared machine (+-15 % here over minutes) mostly cancels."""
    import statistics

    path = str(f.path)
    llm = LlamaSession(path, len(ids) + n_decode + 16, threads)
    need = len(ids) + n_decode + 8
    extra = ["--ctx-size", str(need)] if need > NODE_CTX else []
    times: dict[str, list[tuple[float, float]]] = {"llama.cpp": [], "route": [], "rpc": []}
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(tempfile.NamedTemporaryFile("w+", prefix="bench-nodes-", suffix=".log"))
        nodes = start_nodes(even_split(N_LAYERS, 3), path, threads=threads, extra=extra, stderr=log)
        stack.callback(stop_nodes, nodes)
        route = RemoteRoute([n.url for n in nodes], 120.0)
        addrs = stack.enter_context(rpc_servers(threads, env))[1] if env is not None else None
        for r in range(rounds + 1):
            ref = run_session(llm.reset(), ids, n_decode)
            session = route.open(need, GREEDY)
            try:
                got = run_session(session, ids, n_decode)
            finally:
                session.close()
            rpc = None
            if addrs is not None:
                out = llama_bench(
                    path,
                    ["-p", str(len(ids)), "-n", str(n_decode), "-d", f"0,{len(ids)}", *rpc_bench_args(threads, addrs)],
                    env,
                    1,
                    len(ids),
                )[0]
                rpc = (out["prefill"], out["decode"])
            if r:
                times["llama.cpp"].append(ref)
                times["route"].append(got)
                if rpc:
                    times["rpc"].append(rpc)
            say(
                f"  round {r}{' (warm-up)' if not r else ''}: llama.cpp {ref[0]:.1f} / {ref[1]:.1f}, route "
                f"{got[0]:.1f} / {got[1]:.1f}"
                + (f", RPC {rpc[0]:.1f} / {rpc[1]:.1f}" if rpc else "")
                + " tok/s (prefill / decode)"
            )
    llm.close()
    out = {
        name: {"prefill": statistics.median(t[0] for t in ts), "decode": statistics.median(t[1] for t in ts)}
        for name, ts in times.items()
        if ts
    }
    for other in ("llama.cpp", "rpc"):
        if times[other]:
            out["route"][f"ratio_{other}"] = {
                key: statistics.median(a[k] / b[k] for a, b in zip(times["route"], times[other]))
                for k, key in enumerate(("prefill", "decode"))
            }
    return out


# -- table -----------------------------------------------------------------------------------------------
def fmt(x, spec=".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def route_table(f: GGUFModelFile, ids: list[int], n_decode: int, T: int, rounds: int, have_tools: bool) -> dict:
    """Print the interleaved route / llama.cpp / RPC table (bench_route_interleaved); its numbers."""
    say(
        f"3-node route vs llama.cpp and llama.cpp RPC, interleaved ({rounds} rounds; nodes, rpc-servers and "
        f"llama.cpp stay loaded; each round runs all of them in turn):"
    )
    rinter = bench_route_interleaved(f, ids, n_decode, T, rounds, dict(os.environ) if have_tools else None)
    say("| engine | prefill tok/s | decode tok/s | route prefill ratio | route decode ratio |")
    say("|---|---:|---:|---:|---:|")
    names = {
        "llama.cpp": "llama.cpp in-process",
        "rpc": "llama.cpp RPC (llama-bench + 3 rpc-server)",
        "route": "route, 3 llama.cpp nodes",
    }
    for name, r in rinter.items():
        ratio_of = rinter["route"].get(f"ratio_{name}")
        say(
            f"| {names[name]} | {r['prefill']:.1f} | {r['decode']:.1f} | "
            + (f"{ratio_of['prefill']:.2f} | {ratio_of['decode']:.2f} |" if ratio_of else "| |")
        )
    say("Route ratios: median over the rounds of (route / engine) in the same round.")
    return rinter


def report_targets(inter: dict | None, rinter: dict, T: int) -> None:
    """The issue's targets, from the interleaved tables (``inter`` None: the in-process ones not run)."""
    say("Targets (issue):")
    local1, ref_inter = (inter["backend, 1 shard"], inter["llama.cpp"]) if inter else (None, None)

    def check(label: str, value: float | None, goal: float) -> None:
        if value is None:
            say(f"- {label}: n/a")
        else:
            say(f"- {label}: {value:.2f}x (target >= {goal:.2f}x) {'ok' if value >= goal else 'MISSED'}")

    def ratio(a, b, key):
        return a[key] / b[key] if a and b else None

    def route_ratio(other, key):
        r = rinter["route"].get(f"ratio_{other}")
        return r[key] if r else None

    check(
        "in-process decode (llama.cpp backend, 1 shard) vs llama.cpp, interleaved",
        ratio(local1, ref_inter, "decode"),
        0.95,
    )
    check(
        "3-node route decode vs llama.cpp single process, interleaved"
        + ("" if T == 1 else f" (target is for 1 thread; ran {T})"),
        route_ratio("llama.cpp", "decode"),
        0.85,
    )
    check("3-node route decode vs llama.cpp RPC (3 servers), interleaved", route_ratio("rpc", "decode"), 1.0)
    check(
        "in-process prefill (llama.cpp backend, 1 shard) vs llama.cpp, interleaved",
        ratio(local1, ref_inter, "prefill"),
        0.9,
    )
    check("3-node route prefill vs llama.cpp, interleaved", route_ratio("llama.cpp", "prefill"), 0.9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens (default 512, at most 2048)")
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens decoded after the prompt (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the interleaved in-process comparison (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --prefill 64 --decode 8, llama-bench -r 1")
    ap.add_argument(
        "--route-only",
        action="store_true",
        help="only the interleaved comparison of the 3-node route, llama.cpp and llama.cpp RPC",
    )
    args = ap.parse_args()
    if args.quick:
        args.prefill, args.decode, args.rounds = 64, 8, 1
    if not 1 <= args.prefill <= 2048:
        ap.error("--prefill must be in 1..2048 (one llama.cpp batch)")
    T = args.threads
    torch.set_num_threads(T)
    path = str(default_model_path())
    f = GGUFModelFile(path)
    ids = prompt_ids(Tokenizer(path, f.metadata), args.prefill)
    reps = 1 if args.quick else 5

    say(f"# ggufswarm vs llama.cpp — {Path(path).name}")
    say(
        f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; {T} thread(s) per process; "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
    )
    say(
        f"prefill: {len(ids)}-token prompt; decode: {args.decode} greedy tokens; load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    say("")

    have_tools = all((TOOLS_BIN / b).is_file() for b in ("llama-bench", "rpc-server"))
    if args.route_only:
        report_targets(None, route_table(f, ids, args.decode, T, args.rounds, have_tools), T)
        return 0

    rows: list[tuple[str, str, dict | None]] = []
    notes: list[str] = []

    def row(name: str, procs: str, fn) -> dict | None:
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # a failed row is reported, the others still run
            say(f"[{name}] FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            notes.append(f"{name}: failed ({type(e).__name__}: {str(e)[:300]})")
            rows.append((name, procs, None))
            return None
        mem = ""
        if r.get("mem"):
            mem = ", RSS/shard MiB " + " ".join(f"{a / MIB:.0f}/{b / MIB:.0f}" for a, b in r["mem"])
        steps = f", {r['steps']}" if r.get("steps") else ""
        say(
            f"[{name}] prefill {r['prefill']:.1f} tok/s, decode {r['decode']:.1f} tok/s{mem}{steps} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        if r.get("steps"):
            notes.append(f"{name}: {r['steps']} (per hop, mean over the decode steps).")
        rows.append((name, procs, r))
        return r

    ref = row("llama.cpp in-process (llama-cpp-python)", "1", lambda: bench_llama_cpp_python(path, ids, args.decode, T))

    rpc = None
    if not have_tools:
        say(
            f"[llama-bench / llama.cpp RPC] skipped: no llama-bench / rpc-server under {TOOLS_BIN} "
            f"(make llamacpp-tools)"
        )
        notes.append(f"llama-bench and llama.cpp RPC rows skipped: binaries not found under {TOOLS_BIN}")
    else:
        env = dict(os.environ)
        row(
            "llama-bench (whole model)",
            "1",
            lambda: llama_bench(
                path,
                ["-t", str(T), "-p", str(len(ids)), "-n", str(args.decode), "-fa", "1", "-d", f"0,{len(ids)}"],
                env,
                reps,
                len(ids),
            )[0],
        )
        rpc = row(
            "llama.cpp RPC: llama-bench + 3 rpc-server",
            "4 (client + 3 servers)",
            lambda: bench_rpc(f, len(ids), args.decode, T, env, reps),
        )
        if rpc:
            notes.append(
                f"llama.cpp RPC: llama-bench -t {T} --rpc (3 x rpc-server -t 1 on 127.0.0.1) -ngl 99 "
                f"-ts {RPC_SPLIT} -fa 1. Placement llama.cpp reported: {rpc['layout']}. The output layer "
                f"is the tied token_embd (Q8_0); the token embedding lookup stays in the llama-bench "
                f"process (CPU_Mapped); rpc-servers hold weights in plain CPU buffers (no CPU_REPACK). "
                f"RSS is each server's peak during the run; shard MiB excludes token_embd (client side)."
            )
        notes.append(
            "llama-bench: prefill is its pp test (random tokens, its own warm-up, average of "
            f"{reps} run(s)); decode is its tg test after a context of the prompt's length (-d), like every other row."
        )

    row(
        "generate in-process, llama.cpp backend, 1 shard",
        "1",
        lambda: bench_local(path, ids, args.decode, T, "llama.cpp", None),
    )
    row(
        "generate in-process, llama.cpp backend, 3 shards (6,12)",
        "1",
        lambda: bench_local(path, ids, args.decode, T, "llama.cpp", [6, 12]),
    )
    row(
        "generate in-process, torch backend f32, 1 shard",
        "1",
        lambda: bench_local(path, ids, args.decode, T, "torch", None),
    )
    route = {}
    for n in (1, 2, 3):
        route[n] = row(
            f"route, {n} llama.cpp node{'s' if n > 1 else ''}",
            f"{n + 1} ({n} node{'s' if n > 1 else ''} + client)",
            lambda n=n: bench_route(f, n, ids, args.decode, T, "llama.cpp"),
        )
    row("route, 3 torch nodes (f32)", "4 (3 nodes + client)", lambda: bench_route(f, 3, ids, args.decode, T, "torch"))

    say("")
    say(
        "| engine | processes | prefill tok/s | decode tok/s | decode ratio | prefill ratio | "
        "RSS MiB per node / shard MiB |"
    )
    say("|---|---|---:|---:|---:|---:|---|")
    for name, procs, r in rows:
        if r is None:
            say(f"| {name} | {procs} | failed | failed | | | |")
            continue
        dr = r["decode"] / ref["decode"] if ref else None
        pr = r["prefill"] / ref["prefill"] if ref else None
        mem = ", ".join(f"{a / MIB:.0f} / {b / MIB:.0f}" for a, b in r.get("mem", [])) or "–"
        say(
            f"| {name} | {procs} | {fmt(r['prefill'])} | {fmt(r['decode'])} | {fmt(dr, '.2f')} | "
            f"{fmt(pr, '.2f')} | {mem} |"
        )
    say("")
    say(
        f"Ratios: to row 1 (llama.cpp in-process, {T} thread(s)). Shard MiB = GGUF bytes of the node's blk.N.* "
        "tensors (GGUFModelFile.layer_tensor_bytes), + token_embd.weight on the first node, + the head's output "
        "(output.weight, or tied token_embd.weight again: Gemma) and output_norm.weight on the last. RSS: psutil "
        "rss of each node process after the run (includes Python, llama.cpp (torch on torch nodes only), mapped "
        "GGUF pages that were "
        f"touched, and the KV cache: llama.cpp nodes allocate --max-sessions {NODE_SESSIONS} x --ctx-size "
        f"{NODE_CTX} cells up front; a llama.cpp first node reads only the token_embd rows it uses)."
    )
    for note in notes:
        say(f"- {note}")

    say("")
    say(
        f"In-process, interleaved ({args.rounds} rounds in one process, median tok/s; the fairest comparison "
        f"on a shared machine):"
    )
    inter = bench_interleaved(path, ids, args.decode, T, args.rounds)
    say("| engine | prefill tok/s | decode tok/s | prefill ratio | decode ratio |")
    say("|---|---:|---:|---:|---:|")
    for name, r in inter.items():
        say(
            f"| {name} | {r['prefill']:.1f} | {r['decode']:.1f} | {r['prefill'] / inter['llama.cpp']['prefill']:.2f}"
            f" | {r['decode'] / inter['llama.cpp']['decode']:.2f} |"
        )
    say("")
    rinter = route_table(f, ids, args.decode, T, args.rounds, have_tools)
    say("")
    report_targets(inter, rinter, T)
    return 0 if ref is not None else 1


if __name__ == "__main__":
    sys.exit(main())
