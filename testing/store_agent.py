"""Standalone store agents as child processes, for tests, the benchmark and local experiments.

``LocalAgent`` runs ``daybreak agent --standalone`` (optionally inside a
network namespace), waits for its ``ready`` line and stops it with SIGTERM
(hand-off, then exit) or SIGKILL (a crash). Segments are named by pool, so
``cleanup_pool`` removes everything a pool left in /dev/shm. ``NetnsPair``
joins two network namespaces with a veth pair for cross-host tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from daybreak.agent.store.tiers import slug
from daybreak.pool.shm import SHM_DIR


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

    def wait_for(self, text: str, *, timeout_seconds: float = 60.0) -> bool:
        """Wait until a log line contains ``text`` (for example ``event=prefault_done``)."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            if self.proc is None or self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, text: str, *, count: int = 1, timeout_seconds: float = 10.0) -> bool:
        """True once ``text`` appears ``count`` times in the log: lines arrive through a reader thread, and an
        agent often answers a request before it logs about it."""
        deadline = time.monotonic() + timeout_seconds
        while self.log.count(text) < count:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


class NetnsPair:
    """Two network namespaces joined by a veth pair: a stand-in for two hosts on one machine.

    Names are unique per instance and the addresses exist only inside the two
    namespaces; ``close`` deletes both namespaces (and with them the veth pair).
    """

    SUBNET = "10.231"

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = (f"dbA-{tag}", f"dbB-{tag}")
        self._veth = (f"dbva{tag}", f"dbvb{tag}")
        third = int(tag[:2], 16)
        self.addresses = (f"{self.SUBNET}.{third}.1", f"{self.SUBNET}.{third}.2")
        self._made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None when they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root (ip netns add)"
        if shutil.which("ip") is None:
            return "the ip command (iproute2) is not installed"
        probe = f"dbprobe-{uuid.uuid4().hex[:6]}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def _ip(self, *args: str) -> None:
        out = subprocess.run(["ip", *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def open(self) -> NetnsPair:
        try:
            for name in self.names:
                self._ip("netns", "add", name)
                self._made.append(name)
                self._ip("-n", name, "link", "set", "lo", "up")
            self._ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
            for name, veth, address in zip(self.names, self._veth, self.addresses, strict=True):
                self._ip("link", "set", veth, "netns", name)
                self._ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
                self._ip("-n", name, "link", "set", veth, "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for name in self._made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self._veth[0]], capture_output=True)  # if never moved
        self._made = []

    def __enter__(self) -> NetnsPair:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exec_prefix(self, side: int) -> list[str]:
        """Command prefix running a program inside namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.names[side]]
