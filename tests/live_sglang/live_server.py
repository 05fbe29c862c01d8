"""A real SGLang 0.5.23 server on 127.0.0.1, run from the side environment, and its client.

``LiveServer(side, config, checkout, scratch)`` starts ``python -m sglang.launch_server`` from
the side environment (:mod:`side_env`) with a tiny dummy-weight model (:class:`TinyModel`),
the CPU flags of issue 45 and ``--radix-cache-backend urc`` or SGLang's default cache; it
runs in its own session (process group), is waited for within ``START_TIMEOUT`` seconds, and
``stop()`` kills that group by its PID (TERM, then KILL).  The server's output goes to
``log_path``; :meth:`LiveServer.leak_reports` reads SGLang's idle leak check from it and
:meth:`LiveServer.tree_cache_line` the line naming the tree cache.

The client is plain ``urllib`` on ``/generate`` with ``input_ids`` (no tokenizer), one
thread per concurrent request.  :func:`compare` sets two servers' results side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from side_env import SideEnv, server_env

__all__ = [
    "LLAMA",
    "MELLUM_SWA",
    "START_TIMEOUT",
    "SWA_POOL_AS_LARGE_AS_FULL",
    "Comparison",
    "GenRequest",
    "GenResult",
    "LiveServer",
    "ServerConfig",
    "ServerDied",
    "TinyModel",
    "compare",
    "free_port",
]

# On CPU, SGLang sizes the KV budget from the host's free memory after loading the weights
# minus (1 - fraction) x the free memory before; at 0.05 another process taking 5% of the
# machine's memory meanwhile fails the start ("Loaded weights leave no GPU memory").  The
# pools here are fixed by --max-total-tokens, so the fraction only bounds them.
MEM_FRACTION = 0.5
START_TIMEOUT = 600.0  # seconds: a cold start on 2 busy cores imports all of SGLang
REQUEST_TIMEOUT = 600.0  # a long decode on a busy 2-core host
_LEAK = re.compile(r"memory leak detected!.*")
_TREE = re.compile(r"Tree cache initialized: .*")
_MISSING_OP = re.compile(r"sgl_kernel fixture: missing op (\w+)")


class ServerDied(RuntimeError):
    """The server exited (or never answered) before it served; the message has its log tail."""


@dataclass(frozen=True)
class TinyModel:
    """A dummy-weight model: only a ``config.json`` (``--load-format dummy``)."""

    name: str
    config: Mapping[str, Any]

    def write(self, folder: Path) -> Path:
        path = folder / self.name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(dict(self.config), indent=1))
        return path


LLAMA = TinyModel(
    "llama",
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 2048,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)

# A model class SGLang 0.5.23 treats as hybrid sliding-window (``is_hybrid_swa_model``):
# Mellum with one sliding-window layer and one full-attention layer, both with dense MLPs
# (``num_experts`` must still be positive: SGLang sizes its expert map from it).  The window
# (1024) is longer than the live prompts.  SGLang's CPU attention (torch_native) writes a
# sliding-window layer's KV at SWA slots but reads it back at the request's *full-pool* slots
# (``req_to_token``): any full slot at or past the SWA pool's size indexes out of it
# (``IndexError`` in ``_run_sdpa_forward_extend``, with either cache, as soon as the allocator
# hands out a high slot), and so does a prefix whose out-of-window slots were freed.  Servers of
# this model therefore run with ``SWA_POOL_AS_LARGE_AS_FULL``.
MELLUM_SWA = TinyModel(
    "mellum-swa",
    {
        "architectures": ["MellumForCausalLM"],
        "model_type": "mellum",
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention"],
        "mlp_layer_types": ["dense", "dense"],
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
)

# SGLang flags for a MELLUM_SWA server: an SWA pool as large as the full one (see MELLUM_SWA)
SWA_POOL_AS_LARGE_AS_FULL = ("--swa-full-tokens-ratio", "1.0")


@dataclass(frozen=True)
class ServerConfig:
    """One server's configuration; ``backend`` is ``"default"`` or ``"urc"``."""

    backend: str
    model: TinyModel = LLAMA
    page_size: int = 1
    max_total_tokens: int = 8192
    chunked_prefill_size: int = 1024
    kv_events: bool = False
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # extra SGLang plug-ins from modules beside this one: (name, "module:function")
    plugins: tuple[tuple[str, str], ...] = ()

    def with_backend(self, backend: str) -> ServerConfig:
        return dataclasses.replace(self, backend=backend)

    @property
    def label(self) -> str:
        return f"{self.model.name} page {self.page_size} pool {self.max_total_tokens}"


@dataclass(frozen=True)
class GenRequest:
    """One ``/generate`` call: greedy, ``max_new_tokens`` tokens after ``input_ids``."""

    input_ids: tuple[int, ...]
    max_new_tokens: int = 8
    rid: str | None = None
    ignore_eos: bool = True


@dataclass(frozen=True)
class GenResult:
    """What the server answered; ``error`` is set (and the rest empty) when it failed."""

    output_ids: tuple[int, ...] = ()
    cached_tokens: int = -1
    finish: str = ""
    retractions: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def _result(out: Mapping[str, Any]) -> GenResult:
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    return GenResult(
        output_ids=tuple(out["output_ids"]),
        cached_tokens=int(meta["cached_tokens"]),
        finish=str(finish.get("type", "")),
        retractions=int(meta.get("num_retractions", 0)),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """A started SGLang server (see the module docstring); use as a context manager."""

    def __init__(self, side: SideEnv, config: ServerConfig, checkout: Path, scratch: Path) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.log_path = scratch / f"server-{config.backend}-{self.port}.log"
        self.replay: str | None = None
        self.cpu_used = 0.0  # CPU seconds, read when stopped
        self._event_seq = 0
        self._reader: subprocess.Popen[str] | None = None
        self.side = side
        model = config.model.write(scratch / "models")
        args = [
            str(side.python), "-m", "sglang.launch_server",
            "--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
            "--device", "cpu", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--disable-cuda-graph", "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(self.port), "--random-seed", "0",
            "--max-total-tokens", str(config.max_total_tokens),
            "--chunked-prefill-size", str(config.chunked_prefill_size),
            "--mem-fraction-static", str(MEM_FRACTION), "--page-size", str(config.page_size),
            "--log-level", "info",
        ]  # fmt: skip
        if config.backend == "urc":
            args += ["--radix-cache-backend", "urc"]
        elif config.backend != "default":
            raise ValueError(f"backend {config.backend!r}: 'default' or 'urc'")
        if config.kv_events:
            self.replay = f"ipc://{scratch}/kv-replay-{self.port}"
            events = {
                "publisher": "zmq",
                "endpoint": f"ipc://{scratch}/kv-pub-{self.port}",
                "replay_endpoint": self.replay,
                "topic": "kv",
            }
            args += ["--kv-events-config", json.dumps(events)]
        args += list(config.extra_args)
        env = server_env(checkout, scratch, dict(config.env), dict(config.plugins))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=scratch,
            start_new_session=True,  # its own process group: stop() kills all of it by PID
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    # -- lifecycle -----------------------------------------------------------------------

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerDied(f"exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/model_info", timeout=5) as r:
                    if r.status == 200 and "fired up" in self.log():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise ServerDied(f"not ready after {START_TIMEOUT:.0f}s: {self.log_tail()}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) its live processes have used so far (from ``/proc``)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == self.proc.pid:  # its process group
                total += int(fields[11]) + int(fields[12])
        return total / tick

    def stop(self) -> None:
        """Kill the server's process group by its PID (TERM, 10 s grace, then KILL).

        Idempotent; raises nothing for a server that is already gone."""
        if self.proc.poll() is None:
            self.cpu_used = self.cpu_seconds()
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
        # children that outlived the leader (scheduler, detokenizer)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()
        if self._reader is not None:
            self._reader.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reader.wait(timeout=10)
            for pipe in (self._reader.stdin, self._reader.stdout, self._reader.stderr):
                if pipe is not None:
                    pipe.close()
            self._reader = None

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the server's log ----------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 15) -> str:
        return " | ".join(self.log().strip().splitlines()[-lines:])

    def last_error(self, lines: int = 12) -> str:
        """The end of the log's last traceback (its last ``lines``, down to the exception line),
        or the log's tail if it has none: what a crashed scheduler said, without the
        interpreter's shutdown noise after it."""
        log = self.log().splitlines()
        starts = [i for i, line in enumerate(log) if "Traceback (most recent call last)" in line]
        if not starts:
            return self.log_tail(lines)
        block = log[starts[-1] :]
        end = next(
            (i for i, line in enumerate(block[1:], 1) if line[:1] not in (" ", "\t", "")),
            len(block) - 1,
        )
        return " | ".join(block[max(0, end + 1 - lines) : end + 1])

    def tree_cache_line(self) -> str:
        m = _TREE.search(self.log())
        return m.group(0) if m else ""

    def leak_reports(self) -> list[str]:
        """SGLang's idle leak-check reports in the log so far (it logs the first of a kind)."""
        return _LEAK.findall(self.log())

    def missing_ops(self) -> list[str]:
        """``sgl_kernel`` ops the server called that the fixture does not provide."""
        return sorted(set(_MISSING_OP.findall(self.log())))

    def settle(self, seconds: float = 1.0) -> None:
        """Wait while the scheduler turns idle (its leak check runs on every idle turn) before
        the log is read; the server answers nothing that says it has."""
        time.sleep(seconds)

    # -- HTTP ----------------------------------------------------------------------------

    def _post(
        self, path: str, body: Any, *, method: str = "POST", timeout: float = REQUEST_TIMEOUT
    ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            return 0, str(e).encode()

    def generate(self, request: GenRequest) -> GenResult:
        body: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": {
                "max_new_tokens": request.max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": request.ignore_eos,
            },
        }
        if request.rid is not None:
            body["rid"] = request.rid
        status, raw = self._post("/generate", body)
        if status != 200:
            return GenResult(error=f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        return _result(json.loads(raw))

    def generate_batch(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """All of ``requests`` in one ``/generate`` call (a batch body): the scheduler gets
        them together, so what it admits, and retracts, does not hang on arrival times."""
        params = {(r.max_new_tokens, r.ignore_eos) for r in requests}
        if len(params) != 1:
            raise ValueError(f"one batch, one max_new_tokens/ignore_eos: {sorted(params)}")
        (new, ignore_eos), *_ = params
        body = {
            "input_ids": [list(r.input_ids) for r in requests],
            "sampling_params": {
                "max_new_tokens": new,
                "temperature": 0.0,
                "ignore_eos": ignore_eos,
            },
        }
        status, raw = self._post("/generate", body)
        if status != 200:
            err = f"HTTP {status}: {raw[:300].decode(errors='replace')}"
            return [GenResult(error=err) for _ in requests]
        return [_result(out) for out in json.loads(raw)]

    def generate_many(
        self, requests: Sequence[GenRequest], concurrency: int = 1
    ) -> list[GenResult]:
        """Results in the order of ``requests``; ``concurrency`` requests in flight at once."""
        if concurrency <= 1:
            return [self.generate(r) for r in requests]
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(self.generate, requests))

    def abort(self, rid: str) -> int:
        return self._post("/abort_request", {"rid": rid})[0]

    def flush_cache(self, timeout: float = 30.0, attempts: int = 3) -> bool:
        """``/flush_cache``, letting SGLang wait up to ``timeout`` s for the scheduler to turn
        idle (it refuses while a finished request's last batch is still being processed),
        asked up to ``attempts`` times: on a busy host one wait can end before the turn does."""
        for _ in range(attempts):
            if self._post(f"/flush_cache?timeout={timeout}", None)[0] == 200:
                return True
            self.settle(1.0)
        return False

    # -- KV events ------------------------------------------------------------------------

    def take_events(self) -> list[tuple[str, int]]:
        """The KV events published since the last call, as ``(type, blocks)``, decoded with
        SGLang's own ``KVEventBatch`` (in the side environment) from the replay socket."""
        if self.replay is None:
            raise ValueError("this server was started without kv_events")
        if self._reader is None:
            reader = Path(__file__).resolve().parent / "kv_event_reader.py"
            self._reader = subprocess.Popen(
                [str(self.side.python), str(reader), self.replay],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            )
            self._read_line()  # "ready": SGLang's decoder is imported
        assert self._reader.stdin is not None
        self._reader.stdin.write(f"{self._event_seq}\n")
        self._reader.stdin.flush()
        out = json.loads(self._read_line())
        self._event_seq = int(out["next"])
        return [(str(t), int(n)) for t, n in out["events"]]

    def _read_line(self) -> str:
        assert self._reader is not None and self._reader.stdout is not None
        line = self._reader.stdout.readline()
        if not line:
            err = self._reader.stderr.read() if self._reader.stderr else ""
            raise ServerDied(f"kv_event_reader: {err.strip()[-400:]}")
        return line


@dataclass
class Comparison:
    """Two servers' results on one workload, and what differs."""

    case: str
    default: list[GenResult]
    urc: list[GenResult]
    extra: dict[str, tuple[object, object]] = field(default_factory=dict)

    @property
    def requests_ok(self) -> tuple[int, int]:
        return sum(r.ok for r in self.default), sum(r.ok for r in self.urc)

    @property
    def outputs_equal(self) -> bool:
        return [r.output_ids for r in self.default] == [r.output_ids for r in self.urc]

    @property
    def cached_equal(self) -> bool:
        return [r.cached_tokens for r in self.default] == [r.cached_tokens for r in self.urc]

    def mismatches(self, limit: int = 5) -> list[str]:
        out = []
        for i, (d, u) in enumerate(zip(self.default, self.urc, strict=True)):
            if d != u:
                out.append(f"#{i}: default {d} urc {u}")
        return out[:limit]

    def summary(self) -> str:
        d_ok, u_ok = self.requests_ok
        n = len(self.default)
        parts = [
            f"{self.case}: requests ok {d_ok}/{n} vs {u_ok}/{n}",
            f"outputs equal {self.outputs_equal}",
            f"cached_tokens equal {self.cached_equal} "
            f"(sum {sum(r.cached_tokens for r in self.default)} vs "
            f"{sum(r.cached_tokens for r in self.urc)})",
        ]
        parts += [f"{k} {d} vs {u}" for k, (d, u) in self.extra.items()]
        return "; ".join(parts)


def compare(case: str, default: list[GenResult], urc: list[GenResult]) -> Comparison:
    if len(default) != len(urc):
        raise ValueError(f"{case}: {len(default)} default results, {len(urc)} urc results")
    return Comparison(case, default, urc)
