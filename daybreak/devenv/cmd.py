"""``daybreak dev``: build the local tools and run a local cluster in the background.

``dev up`` starts a supervisor process (``dev _serve``) in its own session,
waits until it reports the cluster ready in ``state.json``, prints how to
use it and returns. ``dev down`` asks the supervisor to stop everything.
``dev logs POD`` prints what a pod the process kubelet runs wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from daybreak.devenv import tools
from daybreak.devenv.cluster import ClusterSpec, LocalCluster

DEFAULT_DIR = Path(".daybreak/dev-cluster")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dev_command", metavar="ACTION", required=True)
    t = sub.add_parser("tools", help="build (or find) the control-plane binaries")
    t.add_argument("--print-dir", action="store_true", help="print the cache directory and exit")
    for name in ("up", "_serve"):
        p = sub.add_parser(name, help="start a local cluster in the background" if name == "up" else argparse.SUPPRESS)
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cluster state directory (%(default)s)")
        p.add_argument("--nodes", type=int, default=2, help="fake kwok nodes (%(default)s)")
        p.add_argument("--devices-per-node", type=int, default=8, help="fake accelerators per node (%(default)s)")
        p.add_argument("--accelerator", choices=["sunrise", "nvidia"], default="sunrise")
        p.add_argument("--no-kwok", action="store_true", help="no fake nodes (etcd, apiserver, controllers only)")
        p.add_argument("--no-process-kubelet", action="store_true",
                       help="kwok fakes every pod; `daybreak` pods are not started as local processes")
        p.add_argument("--vllm-python", type=Path, default=None, metavar="PATH",
                       help="interpreter for vLLM engine pods (`python3 -m vllm...`); default: the checkout's "
                            "`make vllm-env` (.venv-vllm), looked up when such a pod starts")
        p.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for readiness")
    d = sub.add_parser("down", help="stop the local cluster")
    d.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    d.add_argument("--purge", action="store_true", help="also delete the state directory")
    s = sub.add_parser("status", help="print the running cluster's state")
    s.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    # Hidden: the process kubelet's tests run this as a pod (probes, exit codes, SIGTERM handling).
    tp = sub.add_parser("_testpod", help=argparse.SUPPRESS)
    tp.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    tp.add_argument("--port", type=int, default=8080)
    tp.add_argument("--ready-after", type=float, default=0.0, help="seconds before /health answers 200")
    tp.add_argument("--exit-after", type=float, default=0.0, help="exit this many seconds after start (0: never)")
    tp.add_argument("--exit-code", type=int, default=0)
    tp.add_argument("--term-delay", type=float, default=0.0, help="seconds to keep running after SIGTERM")
    lg = sub.add_parser("logs", help="print the log of a pod the process kubelet runs")
    lg.add_argument("pod", help="pod name")
    lg.add_argument("-n", "--namespace", default="default")
    lg.add_argument("-c", "--container", help="container name (default: every container)")
    lg.add_argument("--dir", type=Path, default=DEFAULT_DIR)


def run(args: argparse.Namespace) -> int:
    handler = {"tools": _tools, "up": _up, "_serve": _serve, "down": _down, "status": _status,
               "logs": _logs, "_testpod": _testpod}[args.dev_command]
    return handler(args)


def _tools(args: argparse.Namespace) -> int:
    if args.print_dir:
        print(tools.cache_dir())
        return 0
    try:
        paths = tools.ensure(progress=lambda m: print(m, flush=True))
        paths["kubectl"] = tools.find("kubectl")
    except tools.ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in sorted(paths.items()):
        print(f"  {name:24} {path}")
    return 0


def _state_file(directory: Path) -> Path:
    return directory.resolve() / "state.json"


def _read_state(directory: Path) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        state: dict[str, Any] = json.loads(_state_file(directory).read_text())
        return state
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spec(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(nodes=args.nodes, devices_per_node=args.devices_per_node, accelerator=args.accelerator,
                       controllers=True, kwok=not args.no_kwok, process_kubelet=not args.no_process_kubelet,
                       vllm_python=str(args.vllm_python.resolve()) if args.vllm_python else "")


def _up(args: argparse.Namespace) -> int:
    state = _read_state(args.dir)
    if state and state.get("status") == "ready" and _alive(state["supervisor_pid"]):
        print(f"a cluster is already running in {args.dir.resolve()}")
        _print_usage(state)
        return 0
    try:  # fail here, not in the background, when a binary is missing
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl"):
            tools.find(name)
    except tools.ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    directory = args.dir.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    _state_file(directory).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "daybreak", "dev", "_serve", "--dir", str(directory), "--nodes", str(args.nodes),
           "--devices-per-node", str(args.devices_per_node), "--accelerator", args.accelerator,
           "--timeout", str(args.timeout)] + (["--no-kwok"] if args.no_kwok else []) + (
               ["--no-process-kubelet"] if args.no_process_kubelet else []) + (
               ["--vllm-python", str(args.vllm_python.resolve())] if args.vllm_python else [])
    with open(directory / "supervisor.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    print(f"starting a local cluster in {directory} (supervisor pid {proc.pid}, log {directory / 'supervisor.log'})")
    deadline = time.monotonic() + args.timeout + 30
    while time.monotonic() < deadline:
        state = _read_state(directory)
        if state and state.get("status") == "ready":
            _print_usage(state)
            return 0
        if state and state.get("status") == "failed":
            print(f"error: the cluster failed to start: {state.get('error')}", file=sys.stderr)
            return 1
        if proc.poll() is not None:
            print(f"error: the supervisor exited ({proc.returncode}); see {directory / 'supervisor.log'}",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)
    print("error: timed out waiting for the cluster", file=sys.stderr)
    return 1


def _print_usage(state: dict[str, Any]) -> None:
    print(f"cluster ready: apiserver {state['server']}, {state['nodes']} fake node(s)")
    print("use it with:")
    print(f"  export KUBECONFIG={state['kubeconfig']}")
    print("  kubectl get nodes -L daybreak.dev/accelerator,daybreak.dev/accelerator-count")
    print("stop it with: daybreak dev down")
    print(f"KUBECONFIG={state['kubeconfig']}")


def _serve(args: argparse.Namespace) -> int:
    """The background supervisor: run the cluster until SIGTERM/SIGINT."""
    directory = args.dir.resolve()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster = LocalCluster(directory, _spec(args), progress=lambda m: print(m, flush=True))
    state: dict[str, Any] = {"supervisor_pid": os.getpid(), "status": "starting"}
    _state_file(directory).write_text(json.dumps(state))
    try:
        cluster.start(timeout=args.timeout)
    except Exception as exc:
        state.update(status="failed", error=str(exc))
        _state_file(directory).write_text(json.dumps(state))
        print(f"failed: {exc}", flush=True)
        return 1
    state.update(status="ready", server=cluster.server, kubeconfig=str(cluster.kubeconfig),
                 nodes=args.nodes if not args.no_kwok else 0, pids=cluster.pids())
    _state_file(directory).write_text(json.dumps(state))
    print("ready", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        cluster.stop()
        state["status"] = "stopped"
        _state_file(directory).write_text(json.dumps(state))
    return 0


def _down(args: argparse.Namespace) -> int:
    state = _read_state(args.dir)
    if not state:
        print(f"no cluster state in {args.dir.resolve()}")
        return 0
    pid = state.get("supervisor_pid")
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            if not _alive(pid):
                break
            time.sleep(0.1)
    # Belt and braces: a supervisor killed with SIGKILL leaves its components behind.
    for name, cpid in (state.get("pids") or {}).items():
        if _alive(cpid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cpid, signal.SIGKILL)
            print(f"killed leftover {name} (pid {cpid})")
    from daybreak.devenv.kubelet import kill_leftovers

    for pid in kill_leftovers(args.dir.resolve()):
        print(f"killed leftover pod process (pid {pid})")
    if args.purge:
        import shutil

        shutil.rmtree(args.dir.resolve(), ignore_errors=True)
    print("cluster stopped")
    return 0


def _status(args: argparse.Namespace) -> int:
    state = _read_state(args.dir)
    if not state:
        print("no cluster")
        return 1
    alive = _alive(state.get("supervisor_pid", 0))
    print(json.dumps({**state, "supervisor_alive": alive}, indent=2))
    return 0 if alive and state.get("status") == "ready" else 1


def _logs(args: argparse.Namespace) -> int:
    from daybreak.devenv.kubelet import iter_logs

    directory = args.dir.resolve()
    files = [f for f in iter_logs(directory, namespace=args.namespace, pod=args.pod)
             if args.container is None or f.stem == args.container]
    if not files:
        what = f"container {args.container!r} of " if args.container else ""
        print(f"error: no log of {what}pod {args.namespace}/{args.pod} under {directory / 'pods'} (only pods "
              "the process kubelet runs have logs; `kubectl get pods -o wide` lists them)", file=sys.stderr)
        return 1
    for f in files:
        if len(files) > 1:
            print(f"==> {f.stem} <==", flush=True)
        sys.stdout.buffer.write(f.read_bytes())
        sys.stdout.flush()
    return 0


def _testpod(args: argparse.Namespace) -> int:
    """A tiny HTTP server for the process kubelet's tests: /health, /env; exits and handles SIGTERM as told."""
    import http.server

    started = time.monotonic()
    term = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                ok = time.monotonic() - started >= args.ready_after and not term.is_set()
                body, code = (b"ok\n", 200) if ok else (b"not ready\n", 503)
            elif self.path == "/env":
                keys = ("POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "KUBECONFIG", "DAYBREAK_SHM_DIR")
                body, code = json.dumps({k: os.environ.get(k) for k in keys}).encode(), 200
            else:
                body, code = b"not found\n", 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *a: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: term.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"testpod serving on {args.host}:{args.port} pid={os.getpid()}", flush=True)
    while not term.is_set():
        if args.exit_after and time.monotonic() - started >= args.exit_after:
            print(f"testpod exiting with {args.exit_code}", flush=True)
            return int(args.exit_code)
        term.wait(0.05)
    print("testpod got SIGTERM", flush=True)
    time.sleep(args.term_delay)
    print("testpod stopped", flush=True)
    server.shutdown()
    return 0
