"""vmmbuf's exceptions. Every failing call raises one of these, with the
cause in its message (the driver call and its result code, the sizes asked
for, the budget). Out of memory is also a ``torch.OutOfMemoryError`` when
PyTorch is loaded, so code that catches PyTorch's catches vmmbuf's."""

from __future__ import annotations

import sys
from typing import Dict, Optional, Type


class VmmbufError(Exception):
    """The base of every vmmbuf error."""


class OutOfMemoryError(VmmbufError, MemoryError):
    """The device (or the budget) has no room for the request. Transient:
    nothing changed, and the same call may succeed once memory is freed."""


class CapacityError(VmmbufError, ValueError):
    """A growth past the reservation (a GrowableTensor's maximum)."""


class InvalidArgumentError(VmmbufError, ValueError):
    """An argument vmmbuf refuses (a bad size, device, stream or pointer)."""


class UnsupportedError(VmmbufError, NotImplementedError):
    """A feature this device, driver or platform does not offer."""


class NoDeviceError(VmmbufError, RuntimeError):
    """No CUDA driver, or no such device."""


class DriverError(VmmbufError, RuntimeError):
    """A driver or operating-system call failed (the call and code are in
    the message)."""


_KINDS: Dict[str, Type[VmmbufError]] = {
    "out_of_memory": OutOfMemoryError,
    "capacity": CapacityError,
    "invalid_argument": InvalidArgumentError,
    "unsupported": UnsupportedError,
    "no_device": NoDeviceError,
    "driver": DriverError,
}

_TORCH_OOM: Optional[Type[VmmbufError]] = None


def _oom_class() -> Type[VmmbufError]:
    """OutOfMemoryError, also deriving from torch.OutOfMemoryError once
    PyTorch is loaded."""
    global _TORCH_OOM
    torch = sys.modules.get("torch")
    torch_oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if not isinstance(torch_oom, type):
        return OutOfMemoryError
    if _TORCH_OOM is None or torch_oom not in _TORCH_OOM.__mro__:
        _TORCH_OOM = type("OutOfMemoryError", (OutOfMemoryError, torch_oom), {
            "__module__": __name__,
            "__doc__": OutOfMemoryError.__doc__,
        })
    return _TORCH_OOM


def _from_native(kind: str, message: str) -> VmmbufError:
    """The exception for an error the native module reports (called by it)."""
    cls = _oom_class() if kind == "out_of_memory" else _KINDS.get(kind, VmmbufError)
    return cls(message)


__all__ = [
    "VmmbufError",
    "OutOfMemoryError",
    "CapacityError",
    "InvalidArgumentError",
    "UnsupportedError",
    "NoDeviceError",
    "DriverError",
]
