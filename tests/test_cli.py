"""The CLI as a user runs it: streamed completion, telemetry on stderr, one-line errors."""

from __future__ import annotations

import subprocess

import pytest
from tinymodels import write_tiny_model


def run(cli, *args, stdin=None, timeout=300):
    return subprocess.run([*cli, *args], capture_output=True, text=True, input=stdin, timeout=timeout)


def assert_one_line_error(out, *needles):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_streams_completion_and_telemetry(ggufswarm_cli, gemma):
    out = run(ggufswarm_cli, "generate", "The capital of France is", "--max-tokens", "12", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    ids = gemma.tokenizer.encode("The capital of France is")
    from ggufswarm.client.generate import generate
    from ggufswarm.runtime.sampling import SamplingParams

    expected = "".join(generate(gemma.session(64, SamplingParams(temperature=0)), gemma.tokenizer, ids, 12))
    assert out.stdout == expected + "\n"
    assert "TTFT" in out.stderr and "tok/s" in out.stderr and "prompt tokens: 6" in out.stderr


def test_generate_split_equals_single(ggufswarm_cli):
    a = run(ggufswarm_cli, "generate", "Hello, my name is", "--max-tokens", "8", "--temperature", "0")
    b = run(
        ggufswarm_cli, "generate", "Hello, my name is", "--max-tokens", "8", "--temperature", "0", "--split", "6,12"
    )
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


def test_same_seed_same_output(ggufswarm_cli, tiny_dir):
    path = write_tiny_model(tiny_dir / "cli-seed.gguf", "llama")
    args = ["generate", "the a of", "--model", str(path), "--max-tokens", "20", "--temperature", "1.0", "--seed", "42"]
    a, b = run(ggufswarm_cli, *args), run(ggufswarm_cli, *args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    # the seed and the temperature are used: another of either changes the text
    for flag, value in (("--seed", "43"), ("--temperature", "0.3")):
        other = run(ggufswarm_cli, *args, flag, value)  # argparse: the last occurrence wins
        assert other.returncode == 0, other.stderr
        assert other.stdout != a.stdout, (flag, value)


def test_not_a_gguf(ggufswarm_cli, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello, I am not a model\n")
    assert_one_line_error(run(ggufswarm_cli, "generate", "hi", "--model", str(bad)), "not a GGUF file")


def test_truncated_gguf(ggufswarm_cli, tiny_dir, tmp_path):
    good = write_tiny_model(tiny_dir / "cli-trunc.gguf", "llama")
    data = good.read_bytes()
    for cut in (100, len(data) // 2):
        bad = tmp_path / f"truncated-{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert_one_line_error(run(ggufswarm_cli, "generate", "hi", "--model", str(bad)), "truncated")


def test_unsupported_architecture(ggufswarm_cli, tiny_dir, tmp_path):
    data = bytearray(write_tiny_model(tiny_dir / "cli-arch.gguf", "llama").read_bytes())
    pos = data.index(b"llama", data.index(b"general.architecture"))
    data[pos : pos + 5] = b"rwkv7"
    bad = tmp_path / "rwkv.gguf"
    bad.write_bytes(bytes(data))
    assert_one_line_error(
        run(ggufswarm_cli, "generate", "hi", "--model", str(bad)), "unsupported architecture 'rwkv7'", "gemma3"
    )


def test_prompt_over_the_cap(ggufswarm_cli, tiny_dir):
    path = write_tiny_model(tiny_dir / "cli-ctx.gguf", "llama", context_length=256)
    out = run(ggufswarm_cli, "generate", "-", "--model", str(path), stdin="the a of and " * 100)
    assert_one_line_error(out, "prompt is", "limit", "256")


def test_missing_file_and_bad_split(ggufswarm_cli, tiny_dir):
    assert_one_line_error(run(ggufswarm_cli, "generate", "hi", "--model", "/nonexistent.gguf"), "no such file")
    path = write_tiny_model(tiny_dir / "cli-split.gguf", "llama")
    for split in ("3,2", "6,,12", "0,3", "x"):  # (6,,12 once ran as 6,12)
        out = run(ggufswarm_cli, "generate", "hi", "--model", str(path), "--split", split)
        assert out.returncode == 2 and "Traceback" not in out.stderr and "split points" in out.stderr  # (argparse's)
    out = run(ggufswarm_cli, "generate", "hi", "--model", str(path), "--split", "1,9")  # past the model's 2 layers
    assert_one_line_error(out, "split points")


def test_help_teaches(ggufswarm_cli):
    out = run(ggufswarm_cli, "generate", "--help")
    assert out.returncode == 0 and "--split" in out.stdout and "greedy" in out.stdout


def test_bad_numbers_are_one_line_errors(ggufswarm_cli, tiny_dir):
    path = write_tiny_model(tiny_dir / "cli-nums.gguf", "llama")
    for args in (
        ["generate", "hi", "--threads", "-3"],
        ["generate", "hi", "--max-tokens", "-1"],
        ["perplexity", "x.txt", "--chunks", "0"],
    ):
        out = run(ggufswarm_cli, *args, "--model", str(path))
        assert out.returncode != 0 and "Traceback" not in out.stderr and "must be at least" in out.stderr
    # an option the chosen backend would ignore is refused, not silently dropped
    out = run(ggufswarm_cli, "generate", "hi", "--dtype", "bfloat16", "--model", str(path))
    assert out.returncode != 0 and "Traceback" not in out.stderr and "--backend torch" in out.stderr


def test_perplexity_chunks_limit(ggufswarm_cli, tiny_dir, tmp_path):
    path = write_tiny_model(tiny_dir / "cli-ppl.gguf", "llama")
    text = tmp_path / "t.txt"
    text.write_text("the a of and to in is it that was " * 20)
    one = run(ggufswarm_cli, "perplexity", str(text), "--model", str(path), "--ctx-size", "16", "--chunks", "1")
    assert one.returncode == 0, one.stderr
    assert one.stderr.count("[") == 1 and one.stdout.startswith("perplexity: ")
    dir_err = run(ggufswarm_cli, "perplexity", str(tmp_path), "--model", str(path))
    assert_one_line_error(dir_err, "is a directory")


def test_cache_command_serves_and_stops(ggufswarm_cli, tmp_path):
    """``ggufswarm cache`` prints a ready line, needs the swarm token, and stops cleanly on SIGTERM."""
    import json
    import os
    import signal
    import urllib.error
    import urllib.request

    env = dict(os.environ, GGUFSWARM_TOKEN="t0k", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [*ggufswarm_cli, "cache", "--dir", str(tmp_path / "c"), "--port", "0", "--max-bytes", "64M"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ggufswarm cache ready: http://"), line + proc.stderr.read()
        url = line.split()[3]
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert denied.value.code == 401
        req = urllib.request.Request(url + "/health", headers={"X-Ggufswarm-Token": "t0k"})
        health = json.loads(urllib.request.urlopen(req, timeout=10).read())
        assert health["max_bytes"] == 64 * 2**20 and health["snapshots"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    bad = run(ggufswarm_cli, "cache", "--dir", str(tmp_path), "--max-bytes", "lots")
    assert bad.returncode != 0 and "size must be" in bad.stderr


def test_model_alias_smollm2(ggufswarm_cli):
    """``--model smollm2`` names the chat model the set-up installs (a file of that name would win)."""
    from ggufswarm.artifact.default_model import default_model_path, model_name, resolve_model, smollm2_path

    assert resolve_model("smollm2") == smollm2_path() and resolve_model("x.gguf").name == "x.gguf"
    # publish and demo name a model alike: the alias, else the file name
    assert model_name("smollm2", smollm2_path()) == "smollm2"
    assert model_name(None, default_model_path()) == "gemma-3-270m-q4_k_m"
    assert model_name("dir/x.gguf", resolve_model("dir/x.gguf")) == "x"
    args = ["Name a color.", "--chat", "--max-tokens", "4", "--temperature", "0"]
    by_name = run(ggufswarm_cli, "generate", *args, "--model", "smollm2")
    by_path = run(ggufswarm_cli, "generate", *args, "--model", str(smollm2_path()))
    assert by_name.returncode == 0 and by_name.stdout == by_path.stdout and by_name.stdout.strip(), by_name.stderr


def test_start_order_names_and_early_errors(ggufswarm_cli, tiny_dir, tmp_path):
    """What a new user trips on, said at once: a gateway started before its tracker waits for it (one line); a
    node on a port in use fails before fetching anything; a node serving the last layer without --head (or
    layer 0 without --embed) warns; ``publish smollm2`` publishes under that name."""
    import json
    import socket
    import sys
    import urllib.request

    from apphost import AppThread

    from ggufswarm.tracker.app import TrackerConfig, make_app

    path = write_tiny_model(tiny_dir / "cli-order.gguf", "llama", n_layers=4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run(
            ggufswarm_cli,
            "node",
            "--layers",
            "0:4",
            "--embed",
            "--head",
            "--model",
            str(path),
            "--port",
            str(port),
            "--tracker",
            "http://127.0.0.1:9",
            timeout=60,
        )
        assert_one_line_error(out, f"cannot listen on 127.0.0.1:{port}")  # before waiting for the tracker

        gateway = subprocess.Popen(
            [sys.executable, "-m", "ggufswarm.cli", "gateway", "--tracker", f"http://127.0.0.1:{port}", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = gateway.stderr.readline()
            assert "ggufswarm gateway: waiting for the tracker" in line and gateway.poll() is None, line
        finally:
            gateway.kill()
            gateway.communicate(timeout=30)

    # a port whose only holder is a TIME-WAIT connection (a node killed a moment ago) is free for a new node
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the node's server listens
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first: its port stays in TIME-WAIT
        client.close()
    with pytest.raises(OSError), socket.socket() as plain:
        plain.bind(("127.0.0.1", port))  # what the node's port check did before
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ggufswarm.cli",
            "node",
            "--layers",
            "0:4",
            "--embed",
            "--head",
            "--model",
            str(path),
            "--port",
            str(port),
            "--tracker",
            "http://127.0.0.1:9",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = node.stderr.readline()
        assert "waiting for the tracker" in line, line
    finally:
        node.kill()
        node.communicate(timeout=30)

    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ggufswarm.cli",
            "node",
            "--layers",
            "2:4",
            "--model",
            str(path),
            "--data-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = node.stderr.readline()
        assert "WARNING: layers 2:4 end at the model's last layer without --head" in line, line
    finally:
        node.kill()
        node.communicate(timeout=30)

    with AppThread(lambda: make_app(TrackerConfig(db=":memory:"))) as tracker:
        out = run(
            ggufswarm_cli,
            "publish",
            "smollm2",
            "--tracker",
            tracker,
            "--no-seed",
            "--data-dir",
            str(tmp_path / "pub"),
            timeout=120,
        )
        assert out.returncode == 0 and out.stdout.startswith("published smollm2:"), out.stderr
        with urllib.request.urlopen(f"{tracker}/manifests/smollm2", timeout=10) as r:
            assert json.loads(r.read())["manifest"]["name"] == "smollm2"
