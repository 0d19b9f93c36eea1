"""vLLM OpenAI servers on CPU as local child processes, for the connector tests and ``daybreak bench vllm``.

``VllmServer`` starts ``python -m vllm.entrypoints.openai.api_server`` with
the interpreter ``make vllm-env`` prints, in its own session (vLLM forks an
engine core and a worker: stopping the session stops all three), pinned to
one core with ``VLLM_CPU_OMP_THREADS_BIND`` so runs are comparable, and talks
to it over HTTP: completions (with time to first token), prometheus metrics.
Needs only the standard library and httpx, so the main venv drives it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from daybreak.api.enginepod import vllm_kv_transfer_config


def daybreak_transfer_config(*, role: str, endpoints: list[str], token_file: Path, namespace: str,
                             **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for the Daybreak connector outside Kubernetes (``api.enginepod`` builds it)."""
    return vllm_kv_transfer_config(kv_role=role, load_failure_policy=None, extra={
        "endpoints": endpoints, "token_file": str(token_file), "namespace": namespace, **extra})


@dataclass
class Completion:
    """One completion: generated token ids, usage (with cached prompt tokens) and time to first token."""

    token_ids: list[int]
    cached_tokens: int
    prompt_tokens: int
    ttft_seconds: float


@dataclass
class VllmServer:
    """One vLLM server process tree on ``127.0.0.1:port``."""

    python: Path
    model: Path
    port: int
    cpu: int
    log_path: Path
    kv_transfer_config: dict[str, Any] | None = None
    kv_cache_bytes: int = 256 << 20
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    ipc_dir: Path | None = None
    """vLLM's ZeroMQ sockets (``VLLM_RPC_BASE_PATH``) and temp files (``TMPDIR``): a private dir removed at stop."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--port", str(self.port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "2048",
               "--enforce-eager", "--enable-prompt-tokens-details", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def start(self) -> VllmServer:
        """Start the process (returns at once; ``wait_ready`` waits for it)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu),
               "PYTHONSAFEPATH": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB only, and it would win over --kv-cache-memory-bytes
        env.pop("PYTHONHASHSEED", None)  # vLLM's sha256 block hashes are stable across processes only without it
        # vLLM leaves a socket file per engine in its RPC base path (default /tmp) when it exits, and a
        # vllm_dist_<uuid> rendezvous file in the temp dir per start (65 had piled up in /tmp): both go here.
        self.ipc_dir = Path(tempfile.mkdtemp(prefix="vllm-ipc-"))
        env["VLLM_RPC_BASE_PATH"] = str(self.ipc_dir)
        env["TMPDIR"] = str(self.ipc_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.log_path.parent, start_new_session=True)
        return self

    def wait_ready(self, *, timeout_seconds: float = 300.0) -> VllmServer:
        """Wait for ``/health``; raises with the log's tail when the server exits or times out."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM on port {self.port} not ready after {timeout_seconds:.0f} s:\n{self.log_tail()}")

    def wait_exit(self, *, timeout_seconds: float = 300.0) -> int:
        """Wait for the server to exit on its own (a start-up that must fail); returns its exit code."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_seconds)
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM the whole session, then SIGKILL what is left after 30 s."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                break
        self.proc.poll()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: list[int], *, max_tokens: int, timeout_seconds: float = 300.0) -> Completion:
        """A greedy completion of a token-id prompt, streamed so that the first token's arrival is timed."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                "ignore_eos": True}
        tokens: list[int] = []
        usage: dict[str, Any] = {}
        started = time.perf_counter()
        first = None
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=timeout_seconds) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"completion failed: HTTP {resp.status_code}: {resp.read()[:500]!r}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - started
                    tokens += ids
                usage = chunk.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        return Completion(token_ids=tokens, cached_tokens=int(details.get("cached_tokens") or 0),
                          prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          ttft_seconds=first if first is not None else float("nan"))

    def post(self, path: str, body: dict[str, Any], *, timeout_seconds: float = 300.0) -> dict[str, Any]:
        """A plain JSON POST (the way a router forwards a request)."""
        resp = httpx.post(self.url + path, json=body, timeout=timeout_seconds)
        if resp.status_code != 200:
            raise RuntimeError(f"POST {path} failed: HTTP {resp.status_code}: {resp.text[:500]}")
        result: dict[str, Any] = resp.json()
        return result

    def metric(self, name: str) -> float:
        """Sum of a prometheus metric's samples (e.g. ``vllm:external_prefix_cache_hits_total``)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
