"""``daybreak sim-engine --startup-seconds``: the engine listens but stays unready while it "loads the model"."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_engine_loading_its_model_answers_health_503_starting_and_a_sigterm_ends_it() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "daybreak", "sim-engine", "--role", "prefill", "--no-pool",
                             "--host", "127.0.0.1", "--port", str(port), "--startup-seconds", "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        reply = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert reply is not None, "the engine never listened"
        assert reply.status_code == 503 and reply.json()["status"] == "starting"
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": "sim", "prompt": "hi", "max_tokens": 1}, timeout=5)
        assert completion.status_code == 503  # nothing is served while loading
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert "event=loading seconds=600" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_negative_start_up_is_refused_naming_the_flag() -> None:
    run = subprocess.run([sys.executable, "-m", "daybreak", "sim-engine", "--no-pool", "--startup-seconds", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--startup-seconds" in run.stderr
