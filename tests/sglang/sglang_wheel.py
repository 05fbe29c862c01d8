"""Import the real ``sglang==0.5.23`` wheel on a CPU-only machine, for the plug-in tests.

``load()`` fetches the wheel without its dependencies (``pip download --no-deps``) into
``~/.cache/urc-tests/sglang-0.5.23`` (or ``$URC_TEST_CACHE``), unpacks its ``sglang``
package there, installs the few small pure-Python packages the memory-cache and scheduler
modules import into a folder beside it, and makes ``import sglang`` resolve to it.  Modules
that need CUDA, a model config or ``transformers`` are replaced by permissive placeholders
(:class:`_Placeholder`); everything the tests exercise -- the radix-cache registry, the plug-in
loader, the pools and allocators, ``Req``, the allocation helpers, ``PrefillAdder`` and the
release path -- is SGLang's own code.  Everything is cached between runs; ``load()`` raises
:class:`WheelUnavailable` when the wheel or a dependency cannot be fetched (no network).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["VERSION", "WheelUnavailable", "ensure_native_hash", "load", "publish_server_args"]

VERSION = "0.5.23"
_CACHE = Path(os.environ.get("URC_TEST_CACHE", Path.home() / ".cache" / "urc-tests"))
_HOME = _CACHE / f"sglang-{VERSION}"
_ROOT = _HOME / "site"  # the unpacked wheel
_DEPS = _HOME / "deps"  # its small runtime dependencies
# import name -> pip requirement, for what the imported SGLang modules need at import time
_DEPS_NEEDED = {
    "msgspec": "msgspec",
    "psutil": "psutil",
    "pybase64": "pybase64",
    "zmq": "pyzmq",
    "orjson": "orjson",
    "requests": "requests",
    "pydantic": "pydantic",
    "packaging": "packaging",
    "tqdm": "tqdm",
    "numpy": "numpy",
    "PIL": "pillow",
    "starlette": "starlette",
}
# Replaced by placeholders: GPU kernels and model code (CUDA-only or pulling transformers).
_PLACEHOLDERS = (
    "sgl_kernel",
    "torchvision",
    "triton",
    "transformers",
    "dill",
    "sglang.jit_kernel",
    "sglang.kernels.jit",
    "sglang.srt.layers",
    "sglang.srt.model_executor",
    "sglang.srt.configs.model_config",
    "sglang.srt.constrained",
    "sglang.srt.disaggregation",
    "sglang.srt.observability.metrics_collector",
    # torch.compile'd at import (its first use would compile with inductor)
    "sglang.srt.sampling.penaltylib",
)


class WheelUnavailable(RuntimeError):
    """The wheel or one of its small dependencies could not be fetched."""


def _run(cmd: list[str]) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise WheelUnavailable(f"{' '.join(cmd[:5])}...: {detail.strip()[-400:]}") from e


def _ensure_unpacked() -> None:
    marker = _ROOT / "sglang" / "srt" / "mem_cache" / "registry.py"
    if marker.exists():
        return
    wheels = sorted(_HOME.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        _HOME.mkdir(parents=True, exist_ok=True)
        # The wheel's only compiled part (the Rust tree core) is not used here, so the
        # wheel of any Python version serves; ask for the one that exists.
        _run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                f"sglang=={VERSION}", "-d", str(_HOME), "-q",
            ]
        )  # fmt: skip
        wheels = sorted(_HOME.glob(f"sglang-{VERSION}-*.whl"))
        if not wheels:
            raise WheelUnavailable(f"pip download left no sglang-{VERSION} wheel in {_HOME}")
    tmp = _ROOT.with_name("site.partial")
    with zipfile.ZipFile(wheels[0]) as z:
        members = [n for n in z.namelist() if n.endswith(".py") or n.endswith(".txt")]
        z.extractall(tmp, members)
    tmp.rename(_ROOT)  # atomic: a half-unpacked tree is never taken for a whole one


def _ensure_deps() -> None:
    if _DEPS.is_dir() and str(_DEPS) not in sys.path:
        sys.path.append(str(_DEPS))
    missing = []
    for module, requirement in _DEPS_NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(requirement)
    if missing:
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(_DEPS), *missing])
        if str(_DEPS) not in sys.path:
            sys.path.append(str(_DEPS))
        importlib.invalidate_caches()


class _Placeholder:
    """Stands for anything a placeholder module is asked for: callable, subscriptable, a
    decorator that returns what it decorates, a base class that adds nothing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Placeholder(f"{self._name}()")

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __getitem__(self, item: Any) -> Any:
        return _Placeholder(f"{self._name}[]")

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _PlaceholderType(type):
    """Metaclass of a placeholder class: its unknown class attributes are placeholders."""

    def __getattr__(cls, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{cls.__name__}.{item}")


class _PlaceholderInstance:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{type(self).__name__}().{item}")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        # A capitalised name is taken for a class: ``isinstance(x, Name)`` must work
        # (torch asks it of triton's JITFunction, SGLang of its KV quantisation methods).
        value: Any = (
            _PlaceholderType(item, (_PlaceholderInstance,), {"__module__": self.__name__})
            if item[:1].isupper()
            else _Placeholder(f"{self.__name__}.{item}")
        )
        setattr(self, item, value)
        return value


# Real modules inside a placeholder package (the KV-event structs).
_REAL_INSIDE = ("sglang.srt.disaggregation.kv_events",)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in _REAL_INSIDE:
            return None
        if any(fullname == p or fullname.startswith(p + ".") for p in _PLACEHOLDERS):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_loaded = False


def load() -> None:
    """Make ``import sglang`` the 0.5.23 wheel (idempotent; see the module docstring)."""
    global _loaded
    if _loaded:
        return
    if "sglang" in sys.modules:
        raise WheelUnavailable("another sglang is already imported in this process")
    import torch.utils._triton as torch_triton

    # torch remembers whether triton is installed; it must not take the placeholder for it.
    torch_triton.has_triton_package()
    torch_triton.has_triton()

    _ensure_unpacked()
    _ensure_deps()
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.path.insert(0, str(_ROOT))
    # Bare packages: their __init__ modules pull the whole server in.
    for name in ("sglang", "sglang.srt", "sglang.srt.configs"):
        package = types.ModuleType(name)
        package.__path__ = [str(_ROOT.joinpath(*name.split(".")))]
        if name == "sglang":
            package.__version__ = VERSION  # type: ignore[attr-defined]
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, package)
    sys.meta_path.insert(0, _Finder())
    for name in _REAL_INSIDE:
        spec = importlib.util.spec_from_file_location(
            name, _ROOT.joinpath(*name.split(".")).with_suffix(".py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    _loaded = True


def publish_server_args(**fields: Any) -> Any:
    """SGLang's own ``ServerArgs(model_path="dummy", **fields)``, published as the process's
    server args (the config namespaces the cache code reads); returns it."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", **fields)
    # SGLang reads the Mamba checkpoint granularity from the model's config or its FLA
    # kernels (CUDA); a pre-seeded value is its documented way around both.
    args._mamba_cache_chunk_size = max(64, fields.get("page_size", 1))
    get_context().set_server_args(args)
    return args


_NATIVE_HASH = "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp"


def ensure_native_hash() -> None:
    """Make SGLang's storage hash (``get_hash_str``: a C++ extension SGLang builds on first
    use with torch's JIT loader) usable: unpack its source beside the loaded wheel and build
    it once.  Raises :class:`WheelUnavailable` when it cannot be built (no compiler, no
    OpenSSL headers)."""
    load()
    source = _ROOT / _NATIVE_HASH
    if not source.exists():
        wheels = sorted(_HOME.glob(f"sglang-{VERSION}-*.whl"))
        if not wheels:
            raise WheelUnavailable("the wheel is gone from the cache")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(_NATIVE_HASH, _ROOT)
    from sglang.srt.mem_cache.utils import get_hash_str

    try:
        get_hash_str([1, 2], None, page_size=1)
    except RuntimeError as e:
        raise WheelUnavailable(f"SGLang's native hash does not build here: {e}") from e
