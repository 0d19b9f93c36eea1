"""A PD serving stack as local processes on loopback: store agents, sim engines, a router.

For the process tests and ``daybreak bench serving``: no Kubernetes, every
part the real command (``daybreak agent --standalone``, ``daybreak
sim-engine``, ``daybreak router``) with its log in a file. ``Stack.close()``
stops everything it started (SIGTERM, then SIGKILL) and unlinks the pool's
shared memory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

HOST = "127.0.0.1"


def _get(url: str, *, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


@dataclass
class Proc:
    """One daybreak sub-command as a child process, logging to ``log``."""

    name: str
    args: list[str]
    log: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, *, timeout_seconds: float = 60.0) -> Proc:
        """Start and wait until ``/health`` answers 200."""
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", **self.env}
        with self.log.open("ab") as sink:
            self.proc = subprocess.Popen([sys.executable, "-m", "daybreak", *self.args], stdout=sink,
                                         stderr=subprocess.STDOUT, env=env, cwd="/")
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if _get(f"http://{self.address}/health", timeout=1.0)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{self.name} did not become healthy in {timeout_seconds:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics(self) -> str:
        return _get(f"http://{self.address}/metrics")[1].decode()

    def stop(self, *, timeout_seconds: float = 30.0) -> None:
        """SIGTERM (drain), then SIGKILL after ``timeout_seconds``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _labels(text: str) -> dict[str, str]:
    return dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', text))


def metric_sum(text: str, selector: str) -> float:
    """Sum of the samples of ``selector`` in Prometheus text: ``name`` or ``name{label="v",...}`` (a subset)."""
    name, _, want = selector.partition("{")
    wanted = _labels(want)
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        base, _, labels = key.partition("{")
        if base != name or any(_labels(labels).get(k) != v for k, v in wanted.items()):
            continue
        try:
            total += float(value)
        except ValueError:
            continue
    return total


@dataclass
class Stack:
    """Agents, engines and a router on loopback; build with ``add_*`` then use ``router.address``."""

    directory: Path
    block_tokens: int = 16
    block_bytes: int = 4096
    kv_namespace: str = "sim"
    time_scale: float = 1.0
    engine_flags: list[str] = field(default_factory=list)
    pool_name: str = field(default_factory=lambda: f"s{uuid.uuid4().hex[:8]}")
    agents: list[LocalAgent] = field(default_factory=list)
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    router: Proc | None = None

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.token_file = self.directory / "token"

    @property
    def layout_json(self) -> str:
        return json.dumps({"numLayers": 32, "numKVHeads": 8, "headDim": 128, "dtype": "bfloat16",
                           "blockTokens": self.block_tokens})

    @property
    def pool_endpoints(self) -> str:
        return ",".join(a.address for a in self.agents)

    def add_agents(self, count: int = 1, *, dram: str = "256Mi") -> list[LocalAgent]:
        peers = [f"{HOST}:{free_port()}" for _ in range(count)]
        for i, address in enumerate(peers):
            agent = LocalAgent(address=address, token_file=self.token_file, pool=self.pool_name, dram=dram,
                               peers=[p for j, p in enumerate(peers) if j != i],
                               log_path=self.directory / f"agent-{i}.log")
            self.agents.append(agent)
            agent.start()
        return self.agents

    def engine(self, role: str, *, pool: bool = True, extra: Sequence[str] = ()) -> Proc:
        """Start one sim engine of ``role`` (prefill, decode or both)."""
        port = free_port()
        args = ["sim-engine", "--role", role, "--host", HOST, "--port", str(port),
                "--kv-namespace", self.kv_namespace, "--kv-layout", self.layout_json,
                "--block-bytes", str(self.block_bytes), "--time-scale", str(self.time_scale),
                "--log-level", "warning", *self.engine_flags, *extra]
        args += ["--pool-endpoints", self.pool_endpoints, "--token-file", str(self.token_file)] if pool \
            else ["--no-pool"]
        group = self.prefill if role == "prefill" else self.decode
        proc = Proc(f"{role}-{len(group)}", args, self.directory / f"{role}-{len(group)}.log", port)
        group.append(proc)
        return proc.start()

    def start_router(self, *, pool_lookup: bool = True, static: bool = True, extra: Sequence[str] = (),
                     port: int | None = None, env: dict[str, str] | None = None, cache_statistics: bool = True,
                     debug_headers: bool = True) -> Proc:
        """Start (or restart on the same port) the router over the engines started so far.

        ``static=False`` leaves discovery to ``extra`` (e.g. ``--prefill-service``); ``pool_lookup``
        passes the agents, token and kvNamespace. ``cache_statistics`` and ``debug_headers`` (on here, off
        in a deployed router) let tests and the benchmark read hit rates and which pod served.
        """
        port = port or (self.router.port if self.router else free_port())
        args = ["router", "--host", HOST, "--port", str(port), "--kv-layout", self.layout_json,
                "--log-level", "warning"]
        if static:
            args += ["--decode-endpoints", ",".join(p.address for p in self.decode)]
            if self.prefill:
                args += ["--prefill-endpoints", ",".join(p.address for p in self.prefill)]
        if pool_lookup and self.agents:
            args += ["--pool-endpoints", self.pool_endpoints, "--token-file", str(self.token_file),
                     "--kv-namespace", self.kv_namespace]
        args += ["--cache-statistics"] * cache_statistics + ["--debug-headers"] * debug_headers
        args += list(extra)
        self.router = Proc("router", args, self.directory / "router.log", port, env=dict(env or {}))
        return self.router.start()

    def close(self) -> None:
        """Stop everything (engines and router drain first), then the agents; unlink the pool's shm."""
        for proc in [*([self.router] if self.router else []), *self.prefill, *self.decode]:
            proc.stop(timeout_seconds=10)
        for agent in self.agents:
            agent.kill()
        cleanup_pool(self.pool_name)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
