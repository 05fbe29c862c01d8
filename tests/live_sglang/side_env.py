"""The side environment a live SGLang 0.5.23 server runs in on a CPU-only machine.

``ensure()`` builds it once into ``~/.cache/urc-tests/sglang-live-0.5.23`` (or
``$URC_TEST_CACHE/sglang-live-0.5.23``) and returns it; later calls find the ``READY`` file
and return at once.  The recipe (issue 45, measured on these machines):

- a venv with the CPU build of ``torch==2.13.0``;
- ``sglang==0.5.23`` with ``--no-deps`` (it pins a CUDA torch) and the packages its import
  chain needs (:data:`IMPORT_CHAIN`, found by importing the server until nothing was missing;
  SGLang's own pins where it has one);
- ``torchvision`` with ``--no-deps``: PyPI's build is a CUDA one, whose
  ``_meta_registrations.py`` registers fakes for ``torchvision::nms``/``qnms`` unconditionally
  and fails at import on a CPU torch (``operator torchvision::nms does not exist``); SGLang
  imports ``torchvision.transforms`` indirectly.  The two registrations get the guard the
  others in that file already have (``torchvision.extension._has_ops()``);
- the ``sgl_kernel`` test fixture (``sgl_kernel_fixture/``, copied into the environment and
  put on its path by a ``.pth`` file): PyPI has no CPU build of sgl-kernel.

The project under test is not installed there: :func:`server_env` puts the checkout on
``PYTHONPATH`` and, beside it, a generated ``dist-info`` carrying the project's own
``sglang.srt.plugins`` entry point from its ``pyproject.toml``, so SGLang's plug-in loader
finds ``urc`` exactly as it finds an installed one, and every checkout (a worktree, CI's clean
copy) tests its own code with the same cached environment.

Run as a script (``python tests/live_sglang/side_env.py``) it builds the environment and
prints where it is; it exits 3 with one line when it cannot be built (no PyPI).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "IMPORT_CHAIN",
    "SGLANG_VERSION",
    "SIDE_EXTRAS",
    "SideEnv",
    "SideEnvUnavailable",
    "ensure",
    "home",
    "server_env",
]

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
# What `import sglang.launch_server` and the scheduler/model-runner chain need on CPU, with
# SGLang 0.5.23's own pins where it has one (its other requirements are CUDA kernels, model
# families and front-end extras the CPU server never imports).
IMPORT_CHAIN = (
    "numpy",
    "fastapi",
    "uvicorn",
    "uvloop",
    "orjson",
    "pybase64",
    "pyzmq",
    "msgspec",
    "psutil",
    "pydantic",
    "setproctitle",
    "python-multipart",
    "xxhash",
    "einops",
    "interegular",
    "partial_json_parser",
    "prometheus-client",
    "transformers==5.19.0",
    "tokenizers==0.23.2",
    "safetensors",
    "huggingface_hub",
    "scipy",
    "requests",
    "aiohttp",
    "pillow",
    "tqdm",
    "packaging",
    "triton",  # imported unconditionally by sglang.srt.utils.common; imports without a GPU
    "xgrammar==0.2.7",
    "apache-tvm-ffi==0.1.11",
    "compressed-tensors==0.18.0",
    "loguru",
    "jsonschema",
    "soundfile==0.13.1",
    "ipython",
    "dill",
    "sentencepiece==0.2.1",
    "gguf",
    "openai==2.8.0",
)
#: The project's extras the live cases need inside the server process, installed into an
#: environment built before they were added too (their own stamp, ``EXTRAS``): ``mooncake``,
#: the Mooncake store's client for the ``--hicache-storage-backend mooncake`` case (its wheel
#: needs the verbs libraries ``.ci/run`` installs for the unit suite's Mooncake tests).
SIDE_EXTRAS = ("mooncake",)
_FIXTURE_SRC = Path(__file__).resolve().parent / "sgl_kernel_fixture" / "sgl_kernel"
_GUARD = "if torchvision.extension._has_ops() else (lambda f: f))"


class SideEnvUnavailable(RuntimeError):
    """The side environment cannot be built here (no PyPI, pip failed); the message says why."""


@dataclass(frozen=True)
class SideEnv:
    """A built side environment: its folder and the interpreter that runs SGLang."""

    root: Path
    python: Path


def home() -> Path:
    """The side environment's folder (it may not exist yet)."""
    cache = Path(os.environ.get("URC_TEST_CACHE", Path.home() / ".cache" / "urc-tests"))
    return cache / f"sglang-live-{SGLANG_VERSION}"


def _fixture_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(_FIXTURE_SRC.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _run(cmd: list[str | Path], *, env: dict[str, str] | None = None, timeout: int = 900) -> str:
    try:
        done = subprocess.run(
            [str(c) for c in cmd],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["(no output)"]
        raise SideEnvUnavailable(f"{' '.join(str(c) for c in cmd[:6])}: {tail[0]}") from e
    except (subprocess.TimeoutExpired, OSError) as e:
        raise SideEnvUnavailable(f"{' '.join(str(c) for c in cmd[:6])}: {e}") from e
    return done.stdout


def _guard_torchvision(site: Path) -> None:
    """Give torchvision's two unconditional fake registrations the guard the others have."""
    path = site / "torchvision" / "_meta_registrations.py"
    text = path.read_text()
    if _GUARD in text:
        return
    patched = text
    for op in ("nms", "qnms"):
        old = f'@torch.library.register_fake("torchvision::{op}")\n'
        new = f'@(torch.library.register_fake("torchvision::{op}") {_GUARD}\n'
        if old not in patched:
            raise SideEnvUnavailable(f"{path}: no `{old.strip()}` to guard (torchvision changed)")
        patched = patched.replace(old, new)
    path.write_text(patched)


def _sync_fixture(root: Path, site: Path) -> None:
    """Copy the sgl_kernel fixture into the environment (again when it changed)."""
    dest = root / "fixture" / "sgl_kernel"
    stamp = root / "fixture" / "DIGEST"
    digest = _fixture_digest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(_FIXTURE_SRC, dest, ignore=shutil.ignore_patterns("__pycache__"))
    (site / "urc_live_sgl_kernel_fixture.pth").write_text(f"{dest.parent}\n")
    stamp.write_text(digest)


def _site_packages(python: Path) -> Path:
    out = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return Path(out.strip())


def _build(root: Path, log: list[str]) -> None:
    venv = root / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", venv])
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps: list[tuple[str, list[str | Path]]] = [
        ("torch", [*pip, f"torch=={TORCH_VERSION}"]),
        ("sglang", [*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"]),
        ("import chain", [*pip, *IMPORT_CHAIN]),
        ("torchvision", [*pip, "--no-deps", "torchvision"]),
    ]
    for name, cmd in steps:
        t0 = time.monotonic()
        _run(cmd, timeout=1800)
        log.append(f"{name} {time.monotonic() - t0:.0f}s")
    site = _site_packages(python)
    torch_version = _run([python, "-c", "import torch; print(torch.__version__)"]).strip()
    if not torch_version.endswith("+cpu"):
        raise SideEnvUnavailable(f"torch {torch_version} in the side env is not the CPU build")
    _guard_torchvision(site)
    _sync_fixture(root, site)


def _extra_requirements(checkout: Path) -> list[str]:
    """The requirements of :data:`SIDE_EXTRAS`, as ``checkout``'s ``pyproject.toml`` pins
    them."""
    meta = tomllib.loads((checkout / "pyproject.toml").read_text())
    optional = meta["project"].get("optional-dependencies", {})
    return [req for extra in SIDE_EXTRAS for req in optional.get(extra, [])]


def _sync_extras(root: Path, python: Path) -> None:
    """Install :data:`SIDE_EXTRAS` into the environment (again when their pins changed)."""
    reqs = _extra_requirements(Path(__file__).resolve().parents[2])
    stamp = root / "EXTRAS"
    digest = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:16]
    if stamp.exists() and stamp.read_text() == digest:
        return
    if reqs:
        _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *reqs])
    stamp.write_text(digest)


def _check(root: Path) -> None:
    """Import the server's whole chain once, as a launch would."""
    python = root / "venv" / "bin" / "python"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    env.pop("PYTHONPATH", None)
    _run(
        [
            python,
            "-c",
            "import sglang.launch_server, sglang.srt.entrypoints.http_server, "
            "sglang.srt.managers.scheduler, sgl_kernel; "
            "sgl_kernel.assign_req_to_token_pool_cpu, sgl_kernel.copy_all_layer_kv_cache_cpu",
        ],
        env=env,
        timeout=600,
    )


def ensure() -> SideEnv:
    """Return the side environment, building it first if it has no ``READY`` file.

    Concurrent callers (two test sessions) serialize on a lock file; the loser finds it
    ready.  Raises :class:`SideEnvUnavailable` (with one line saying why) when it cannot be
    built.  Mutates only the side environment's folder.
    """
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    python = root / "venv" / "bin" / "python"
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = root / "READY"
        if not ready.exists():
            log: list[str] = []
            t0 = time.monotonic()
            _build(root, log)
            _check(root)
            ready.write_text(
                f"sglang=={SGLANG_VERSION} torch=={TORCH_VERSION}+cpu built in "
                f"{time.monotonic() - t0:.0f}s ({', '.join(log)})\n"
            )
        else:
            _sync_fixture(root, _site_packages(python))
        _sync_extras(root, python)
    return SideEnv(root=root, python=python)


def _entry_point_dist(checkout: Path, dest: Path, extra: Mapping[str, str]) -> Path:
    """A ``dist-info`` folder holding the checkout's ``sglang.srt.plugins`` entry points (and
    ``extra`` ones, name to ``module:function``)."""
    meta = tomllib.loads((checkout / "pyproject.toml").read_text())
    project = meta["project"]
    plugins = dict(project.get("entry-points", {}).get("sglang.srt.plugins", {}))
    if not plugins:
        raise SideEnvUnavailable(f"{checkout}/pyproject.toml declares no sglang.srt.plugins")
    plugins.update(extra)
    name = str(project["name"]).replace("-", "_")
    version = project.get("version", "0")
    info = dest / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n"
    )
    lines = ["[sglang.srt.plugins]", *(f"{k} = {v}" for k, v in plugins.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dest


def server_env(
    checkout: Path,
    scratch: Path,
    extra: Mapping[str, str] | None = None,
    plugins: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment a server process of ``checkout``'s code runs with.

    ``checkout`` goes first on ``PYTHONPATH`` (its C extensions built in place), then a
    generated folder under ``scratch`` holding the project's plug-in entry point; the CPU
    engine is switched on.  ``extra`` adds or overrides variables; ``plugins`` adds SGLang
    plug-ins (name to ``module:function``) from modules beside this one.
    """
    tag = hashlib.sha256(repr(sorted((plugins or {}).items())).encode()).hexdigest()[:8]
    eps = _entry_point_dist(checkout, scratch / f"entry_points-{tag}", plugins or {})
    path = [str(checkout), str(eps)]
    if plugins:
        path.append(str(Path(__file__).resolve().parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "URC_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


if __name__ == "__main__":
    t0 = time.monotonic()
    try:
        side = ensure()
    except SideEnvUnavailable as e:
        print(f"live SGLang side environment unavailable: {e}")
        sys.exit(3)
    took = time.monotonic() - t0
    print(f"{side.root}: {(side.root / 'READY').read_text().strip()} (this call {took:.0f}s)")
