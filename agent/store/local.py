"""Standalone store agents as child processes, for tests, the benchmark and local experiments.

``LocalAgent`` runs ``daybreak agent --standalone`` (optionally inside a
network namespace), waits for its ``ready`` line and stops it with SIGTERM
(hand-off, then exit) or SIGKILL (a crash). Segments are named by pool, so
``cleanup_pool`` removes everything a pool left in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from daybreak.agent.store.tiers import slug
from daybreak.agent.transfer.segment import SHM_DIR


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cleanup_pool(pool: str) -> None:
    """Unlink every shared-memory file of ``pool`` (segments, journals, probes)."""
    for path in SHM_DIR.glob(f"daybreak-{slug(pool)}-*"):
        path.unlink(missing_ok=True)


class LocalAgent:
    """One standalone agent process; ``address`` is what clients and peers dial."""

    def __init__(self, *, address: str, token_file: Path, pool: str, dram: str = "256Mi",
                 peers: Sequence[str] = (), replicas: int = 1, extra: Sequence[str] = (),
                 netns: str = "", log_path: Path | None = None) -> None:
        self.address = address
        self.token_file = token_file
        self.pool = pool
        self.dram = dram
        self.peers = list(peers)
        self.replicas = replicas
        self.extra = list(extra)
        self.netns = netns
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "daybreak", "agent", "--standalone", "--listen", self.address,
               "--dram", self.dram, "--token-file", str(self.token_file), "--pool", self.pool,
               "--replicas", str(self.replicas), *self.extra]
        if self.peers:
            cmd += ["--peers", ",".join(self.peers)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        return cmd

    def start(self, *, timeout_seconds: float = 60.0) -> LocalAgent:
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
        self.lines = []
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd="/")
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            sink = self.log_path.open("a") if self.log_path else None
            for line in self.proc.stdout:
                self.lines.append(line)
                if sink:
                    sink.write(line)
                    sink.flush()
                if "event=ready" in line:
                    ready.set()
            if sink:
                sink.close()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_seconds
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"agent {self.address} did not become ready:\n{''.join(self.lines[-30:])}")
        return self

    def stop(self, *, timeout_seconds: float = 60.0) -> int:
        """SIGTERM: the agent hands its blocks off, then exits; returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """SIGKILL: a crash, nothing handed off."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    @property
    def log(self) -> str:
        return "".join(self.lines)
