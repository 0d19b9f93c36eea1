"""Run ``daybreak operator`` as a child process (tests, the benchmark and the demo use the real thing).

The process gets its own session so a test can SIGKILL exactly it, logs to a
file the caller names, and exposes /metrics on a loopback port for checks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daybreak_executable() -> str:
    """The ``daybreak`` script next to the running interpreter (the venv's), else the one on PATH."""
    candidate = Path(sys.executable).with_name("daybreak")
    return str(candidate) if candidate.exists() else "daybreak"


@dataclass
class OperatorProcess:
    """One operator replica; ``start()`` it, ``stop()`` or ``kill()`` it."""

    kubeconfig: Path | None  # None: in-cluster mode (KUBERNETES_SERVICE_HOST in ``env``)
    log_path: Path
    namespace: str | None = None
    identity: str = "operator"
    lease_namespace: str = "default"
    resync_seconds: float = 30.0
    extra_args: list[str] = field(default_factory=list)
    metrics_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        if not self.metrics_port:
            self.metrics_port = free_port()
        scope = [f"--namespace={self.namespace}"] if self.namespace else ["--all-namespaces"]
        access = [f"--kubeconfig={self.kubeconfig}"] if self.kubeconfig is not None else []
        args = [daybreak_executable(), "operator", *access, *scope,
                f"--metrics-port={self.metrics_port}", "--metrics-address=127.0.0.1",
                f"--identity={self.identity}", f"--lease-namespace={self.lease_namespace}",
                f"--resync={self.resync_seconds}", *self.extra_args]
        env = {**os.environ, "PYTHONSAFEPATH": "1", **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def metrics(self) -> str:
        """The raw /metrics text."""
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name):
                continue
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def peak_rss_bytes(self) -> int:
        """VmHWM of the process: its peak resident set so far."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (releases the Lease), then SIGKILL after ``timeout``; returns the exit code."""
        if self.process is None:
            return None
        self.kill(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.process.poll() is None:
            self.kill(signal.SIGKILL)
        return self.process.wait()
