"""A real ``mooncake_master`` on 127.0.0.1 for tests: start, kill (a crash) and restart on the
same port.

The binary ships inside the ``mooncake-transfer-engine-non-cuda`` wheel, next to the
``mooncake`` package; ``find_master_binary()`` returns ``None`` when the package or the
binary is missing (callers skip).  Readiness is polled with a TCP connect under a deadline.
The master keeps its metadata in memory: a restarted master knows no key stored before.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
from pathlib import Path
from typing import IO

from valkey_server import free_port, wait_until

__all__ = ["MooncakeMaster", "find_master_binary"]


def find_master_binary() -> Path | None:
    """The ``mooncake_master`` of the installed ``mooncake`` package, or ``None``."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "mooncake_master"
    return binary if binary.exists() else None


class MooncakeMaster:
    """One master process; :meth:`kill` then :meth:`start` restarts it on the same ports.

    ``lease_ttl_ms`` is the master's ``--default_kv_lease_ttl``: how long a read's lease on
    an object lasts.  The unit tests keep it at 50 ms (a page read a moment ago is removable
    at once); a reader that copies a batch from another client's segment over TCP on a busy
    host needs longer, or its get fails with ``LEASE_EXPIRED`` (Mooncake's default is 5 s).
    """

    def __init__(self, binary: Path, log_path: Path, lease_ttl_ms: int = 50) -> None:
        self.binary = binary
        self.log_path = log_path
        self.lease_ttl_ms = lease_ttl_ms
        self.port = free_port()
        self.metrics_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port`` for ``MooncakeConfig.master_address``."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process and wait until it accepts connections."""
        assert self._process is None, "already running"
        self._log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            [
                str(self.binary),
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--enable_metric_reporting=false",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        process = self._process

        def accepts() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited; see {self.log_path}")
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True

        wait_until(accepts, f"mooncake_master on port {self.port}")

    def kill(self) -> None:
        """SIGKILL the process (a crash, not a shutdown) and reap it."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
