"""A stand-in for ``nvidia-cuda-mps-control``, so the MPS supervisor runs unchanged without a GPU.

Usage mirrors the real binary::

    CUDA_MPS_PIPE_DIRECTORY=... CUDA_MPS_LOG_DIRECTORY=... python mps_standin.py -d   # daemonise
    echo get_default_active_thread_percentage | CUDA_MPS_PIPE_DIRECTORY=... python mps_standin.py

``-d`` starts a detached server listening on a unix socket ``control`` in the pipe directory, writes
its pid to ``standin.pid`` there, and returns once it listens (exit 1 if one already answers).
Without ``-d`` each stdin line is sent to the server and its answer printed; exit 1 when no daemon
answers. As with the real front end, a rejected command prints ``Error: ...`` on stdout and the exit
status stays 0.

Commands, with the documented semantics of the real daemon (NVIDIA MPS docs, "Tools and Interface
Reference"): ``get_server_list``; ``start_server -uid <uid>`` (what a client's first connection does:
a server, with a made-up PID, that takes the *default* limits in force at that moment);
``shutdown_server <pid> [-f]``; ``set_default_active_thread_percentage <pct>`` and
``set_default_device_pinned_mem_limit <dev> <value>`` (reach only servers spawned later);
``set_active_thread_percentage <pid> <pct>`` and ``set_device_pinned_mem_limit <pid> <dev> <value>``
(one running server: clients that connect to it afterwards); the matching ``get_*`` commands; ``quit``.
Memory values are an integer followed by ``M`` or ``G``. Two commands exist only here, to stand for
what a CUDA client's driver does: ``_client_connect <uid> <pid>`` (a client of that UID connects: to
the running server of its UID, or a new server with the defaults in force; while a server of
another UID runs, the client waits, as the real daemon queues it) and ``_client_exit <pid>``.
``GPU_SLICE_MPS_STANDIN_REFUSE`` (comma list of command prefixes, read by the daemon) makes it reject
those commands, for failure tests.

So that test runs never leave it behind, the server also exits when its pipe directory disappears or
after ``GPU_SLICE_MPS_STANDIN_LIFETIME_S`` seconds (if set).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SOCKET_NAME = "control"
PID_NAME = "standin.pid"
LOCK_NAME = "control_lock"
"""Held (flock) by the running daemon, as the real one holds its lock: ``-d`` refuses while it is held,
even when the daemon hangs and does not answer."""
_DEFAULT_PIPE = "/tmp/nvidia-mps"
_DEFAULT_LOG = "/var/log/nvidia-mps"
_MEMORY = re.compile(r"^[1-9][0-9]*[MG]$")
_FIRST_SERVER_PID = 40000


@dataclass
class _Server:
    uid: str
    active_thread_percentage: float
    pinned: dict[str, str]
    clients: list[int] = field(default_factory=list)


@dataclass
class _Daemon:
    """What the stand-in remembers: the defaults and each (made-up) server's own limits."""

    active_thread_percentage: float = 100.0
    pinned: dict[str, str] = field(default_factory=dict)
    servers: dict[int, _Server] = field(default_factory=dict)
    next_pid: int = _FIRST_SERVER_PID
    refuse: tuple[str, ...] = ()


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
    refuse = tuple(p for p in os.environ.get("GPU_SLICE_MPS_STANDIN_REFUSE", "").split(",") if p)
    state = _Daemon(refuse=refuse)
    os.chdir(pipe)
    lock = os.open(LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 1  # another instance holds it
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


def _percentage(text: str) -> float | None:
    try:
        pct = float(text)
    except ValueError:
        return None
    return pct if 0 < pct <= 100 else None


def _answer(line: str, state: _Daemon) -> tuple[str, bool]:
    words = line.split()
    if not words:
        return "", False
    cmd, args = words[0], words[1:]
    if any(cmd.startswith(prefix) for prefix in state.refuse):
        return f"Error: {cmd} refused (GPU_SLICE_MPS_STANDIN_REFUSE)\n", False
    if cmd == "quit":
        return "", True
    server: _Server | None = None
    if cmd in ("set_active_thread_percentage", "get_active_thread_percentage", "set_device_pinned_mem_limit",
               "get_device_pinned_mem_limit", "shutdown_server", "get_client_list") and args:
        server = state.servers.get(int(args[0])) if args[0].isdigit() else None
        if server is None:
            return f"Error: no MPS server with PID {args[0]}\n", False
    if cmd == "get_server_list" and not args:
        return "".join(f"{pid}\n" for pid in sorted(state.servers)), False
    if cmd == "start_server" and len(args) == 2 and args[0] == "-uid" and args[1].isdigit():
        state.servers[state.next_pid] = _Server(args[1], state.active_thread_percentage, dict(state.pinned))
        state.next_pid += 1
        return "", False
    if cmd == "shutdown_server" and server is not None and len(args) in (1, 2):
        del state.servers[int(args[0])]
        return "", False
    if cmd == "get_client_list" and server is not None:
        return "".join(f"{pid}\n" for pid in server.clients), False
    if cmd == "_client_connect" and len(args) == 2 and args[0].isdigit() and args[1].isdigit():
        mine = [s for s in state.servers.values() if s.uid == args[0]]
        if mine:
            mine[0].clients.append(int(args[1]))
            return "", False
        if state.servers:
            return f"queued: a server of another UID runs ({next(iter(state.servers.values())).uid})\n", False
        state.servers[state.next_pid] = _Server(args[0], state.active_thread_percentage, dict(state.pinned),
                                                [int(args[1])])
        state.next_pid += 1
        return "", False
    if cmd == "_client_exit" and len(args) == 1 and args[0].isdigit():
        for srv in state.servers.values():
            if int(args[0]) in srv.clients:
                srv.clients.remove(int(args[0]))
        return "", False
    if cmd == "get_default_active_thread_percentage" and not args:
        return f"{state.active_thread_percentage:.1f}\n", False
    if cmd == "set_default_active_thread_percentage" and len(args) == 1:
        pct = _percentage(args[0])
        if pct is None:
            return f"Error: invalid percentage {args[0]}\n", False
        state.active_thread_percentage = pct
        return f"{pct:.1f}\n", False
    if cmd == "get_active_thread_percentage" and server is not None and len(args) == 1:
        return f"{server.active_thread_percentage:.1f}\n", False
    if cmd == "set_active_thread_percentage" and server is not None and len(args) == 2:
        pct = _percentage(args[1])
        if pct is None:
            return f"Error: invalid percentage {args[1]}\n", False
        server.active_thread_percentage = pct
        return f"{pct:.1f}\n", False
    if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
        if not _MEMORY.match(args[1]):
            return f"Error: invalid memory limit {args[1]}\n", False
        state.pinned[args[0]] = args[1]
        return "", False
    if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
        return state.pinned.get(args[0], "") + "\n", False
    if cmd == "set_device_pinned_mem_limit" and server is not None and len(args) == 3:
        if not _MEMORY.match(args[2]):
            return f"Error: invalid memory limit {args[2]}\n", False
        server.pinned[args[1]] = args[2]
        return "", False
    if cmd == "get_device_pinned_mem_limit" and server is not None and len(args) == 2:
        return server.pinned.get(args[1], "") + "\n", False
    return f"Error: unrecognized command {line}\n", False


def _locked(pipe: Path) -> bool:
    """Whether a running daemon holds the lock (a hung one too)."""
    try:
        fd = os.open(pipe / LOCK_NAME, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def _daemonise() -> int:
    pipe = _pipe_dir()
    pipe.mkdir(parents=True, exist_ok=True)
    if _locked(pipe):
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
