"""A stand-in accelerator for CPU-only tests: tensors "on the device" that raise on host syncs.

Inside ``with DeviceGuard() as guard:``, tensors made on ``guard.device`` (a factory called
with ``device=guard.device``, or ``.to(guard.device)``) are CPU tensors of the marker class
:class:`DeviceTensor`, and everything computed from them is one too.  The guard then
behaves like a CUDA device under ``torch.cuda.set_sync_debug_mode("error")``, stricter:

- a host sync on a device tensor raises :class:`HostSyncError`: ``.item()``, ``.tolist()``,
  ``.numpy()``, ``.cpu()`` or a blocking ``.to("cpu")``, ``bool()``/``int()``/``float()``,
  ``nonzero``, ``torch.equal``, ``masked_select``, ``unique``, a blocking device-to-host
  ``copy_`` (``non_blocking=True`` is a DMA: allowed);
- an operation that mixes a device tensor with a host tensor (other than a scalar) raises
  :class:`DeviceMismatchError`, except ``copy_``/``to`` (transfers) and indexing
  (``t[idx]``, ``t[idx] = x``, which CUDA allows with host indices).

``.device`` of a device tensor reports ``guard.device``.  After the ``with`` block the
tensors are plain CPU tensors again (compare bytes there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DeviceGuard", "DeviceMismatchError", "DeviceTensor", "HostSyncError"]

FAKE = torch.device("xpu")  # a device type this CPU build has no backend for


class HostSyncError(RuntimeError):
    """A host sync on a device tensor."""


class DeviceMismatchError(RuntimeError):
    """An operation mixing device and host tensors."""


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one on the guarded device (a marker class)."""


T = torch.Tensor
_SYNC: set[Callable[..., Any]] = {
    T.item,
    T.tolist,
    T.numpy,
    T.cpu,
    T.__bool__,
    T.__int__,
    T.__float__,
    T.__index__,
    T.nonzero,
    torch.nonzero,
    torch.equal,
    T.equal,
    T.masked_select,
    torch.masked_select,
    T.unique,
    torch.unique,
}
_TRANSFERS: set[Callable[..., Any]] = {T.copy_, T.to, T.__getitem__, T.__setitem__}
_DEVICE_GET = T.device.__get__  # type: ignore[attr-defined]


def _is_fake(dev: object) -> bool:
    return isinstance(dev, (str, torch.device)) and torch.device(dev).type == FAKE.type


def _tensors(x: object) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


class DeviceGuard(TorchFunctionMode):
    """See the module docstring; ``device`` is the stand-in device."""

    device = FAKE

    def __init__(self) -> None:
        super().__init__()
        self.syncs_checked = 0  # device-tensor operations inspected (the guard was active)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func == _DEVICE_GET:
            return FAKE if isinstance(args[0], DeviceTensor) else func(*args)
        if _is_fake(kwargs.get("device")):  # a factory on the device
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).as_subclass(DeviceTensor)
        if func == T.to:
            return self._to(args, kwargs)
        tensors = list(_tensors((args, kwargs)))
        if not any(isinstance(t, DeviceTensor) for t in tensors):
            return func(*args, **kwargs)
        self.syncs_checked += 1
        if func in _SYNC:
            raise HostSyncError(f"{_name(func)} on a device tensor syncs with the host")
        if func == T.copy_:
            dst, src = args[0], args[1]
            blocking = not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor) and blocking:
                raise HostSyncError("a blocking device-to-host copy_")
        elif func not in _TRANSFERS:
            for t in tensors:
                if not isinstance(t, DeviceTensor) and t.dim() > 0:
                    raise DeviceMismatchError(
                        f"{_name(func)} mixes device tensors with a host tensor "
                        f"{tuple(t.shape)} {t.dtype}"
                    )
        return func(*args, **kwargs)

    def _to(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t = args[0]
        target = kwargs.pop("device", None)
        rest = []
        for a in args[1:]:
            if target is None and isinstance(a, (str, torch.device)):
                target = a
            else:
                rest.append(a)
        non_blocking = bool(kwargs.get("non_blocking", False))
        if isinstance(t, DeviceTensor):
            if target is None or _is_fake(target):
                return T.to(t, *rest, **kwargs)
            if not non_blocking:
                raise HostSyncError("a blocking .to(host) of a device tensor")
            return T.to(t.as_subclass(torch.Tensor), *rest, **kwargs).clone()
        if target is not None and _is_fake(target):
            # A device copy is a snapshot of the host tensor.
            return T.to(t, *rest, **kwargs).clone().as_subclass(DeviceTensor)
        if target is not None:
            kwargs["device"] = target
        return T.to(t, *rest, **kwargs)
