"""A stand-in for ``nvidia-cuda-mps-control``, so the MPS supervisor runs unchanged without a GPU.

Usage mirrors the real binary::

    CUDA_MPS_PIPE_DIRECTORY=... CUDA_MPS_LOG_DIRECTORY=... python mps_standin.py -d   # daemonise
    echo get_default_active_thread_percentage | CUDA_MPS_PIPE_DIRECTORY=... python mps_standin.py

``-d`` starts a detached server listening on a unix socket ``control`` in the pipe directory, writes
its pid to ``standin.pid`` there, and returns once it listens (exit 1 if one already answers).
Without ``-d`` each stdin line is sent to the server and its answer printed; exit 1 when no daemon
answers. Commands: ``set_default_active_thread_percentage <pct>``, ``get_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit <dev> <value>``, ``get_server_list``, ``quit``.

So that test runs never leave it behind, the server also exits when its pipe directory disappears or
after ``GPU_SLICE_MPS_STANDIN_LIFETIME_S`` seconds (if set).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SOCKET_NAME = "control"
PID_NAME = "standin.pid"
_DEFAULT_PIPE = "/tmp/nvidia-mps"
_DEFAULT_LOG = "/var/log/nvidia-mps"


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", _DEFAULT_PIPE)).absolute()


def _log(line: str) -> None:
    log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", _DEFAULT_LOG))
    with contextlib.suppress(OSError), (log_dir / "control.log").open("a") as fh:
        fh.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


def _ask(pipe: Path, line: str, timeout_s: float = 5.0) -> str:
    """One request/answer over the socket. Relative path: unix socket paths are capped at 108 bytes."""
    cwd = os.getcwd()
    os.chdir(pipe)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(SOCKET_NAME)
            sock.sendall(line.encode() + b"\n")
            sock.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
    finally:
        os.chdir(cwd)
    return b"".join(chunks).decode()


def _serve() -> int:
    pipe = _pipe_dir()
    lifetime = float(os.environ.get("GPU_SLICE_MPS_STANDIN_LIFETIME_S", "0") or 0)
    started = time.monotonic()
    state = {"active_thread_percentage": "100.0", "pinned": ""}
    os.chdir(pipe)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET_NAME)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(SOCKET_NAME)
        server.listen(16)
        server.settimeout(0.25)
        (pipe / PID_NAME).write_text(str(os.getpid()))
        _log(f"stand-in MPS control daemon started, pid {os.getpid()}, "
             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}")
        while True:
            if not pipe.is_dir() or (lifetime and time.monotonic() - started > lifetime):
                _log("stand-in exiting: pipe directory gone or lifetime over")
                return 0
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    data = b""
                    while chunk := conn.recv(4096):
                        data += chunk
                except OSError:
                    continue
                line = data.decode(errors="replace").strip()
                answer, stop = _answer(line, state)
                _log(f"{line!r} -> {answer!r}")
                with contextlib.suppress(OSError):
                    conn.sendall(answer.encode())
                if stop:
                    with contextlib.suppress(OSError):
                        os.unlink(SOCKET_NAME)
                        os.unlink(PID_NAME)
                    return 0


def _answer(line: str, state: dict[str, str]) -> tuple[str, bool]:
    words = line.split()
    if not words:
        return "", False
    cmd, args = words[0], words[1:]
    if cmd == "quit":
        return "", True
    if cmd == "get_default_active_thread_percentage":
        return state["active_thread_percentage"] + "\n", False
    if cmd == "set_default_active_thread_percentage" and len(args) == 1:
        try:
            pct = float(args[0])
        except ValueError:
            return f"Invalid percentage {args[0]}\n", False
        state["active_thread_percentage"] = f"{pct:.1f}"
        return state["active_thread_percentage"] + "\n", False
    if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
        state["pinned"] = f"{args[0]}={args[1]}"
        return "", False
    if cmd == "get_server_list":
        return "", False
    return f"Unrecognized command {line}\n", False


def _daemonise() -> int:
    pipe = _pipe_dir()
    pipe.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        _ask(pipe, "get_default_active_thread_percentage", timeout_s=1.0)
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    with contextlib.suppress(FileNotFoundError):
        (pipe / PID_NAME).unlink()
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if child.poll() is not None:
            print(f"stand-in daemon exited at start with {child.returncode}", file=sys.stderr)
            return 1
        if (pipe / PID_NAME).exists():
            return 0
        time.sleep(0.02)
    print("stand-in daemon did not start listening in 10s", file=sys.stderr)
    return 1


def _client() -> int:
    pipe = _pipe_dir()
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        try:
            answer = _ask(pipe, line)
        except OSError as exc:
            print(f"Cannot find MPS control daemon process ({exc})", file=sys.stderr)
            return 1
        sys.stdout.write(answer)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["-d"]:
        return _daemonise()
    if argv[:1] == ["--serve"]:
        return _serve()
    if argv:
        print(f"unsupported arguments {argv}", file=sys.stderr)
        return 2
    return _client()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
