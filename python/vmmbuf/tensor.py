"""``GrowableTensor``: a tensor whose first dimension grows in place. Its
memory is one vmmbuf buffer: a reserved range, chunks mapped as it grows, a
base address that never moves and no copy on growth. It is handed to
PyTorch, CuPy and NumPy through DLPack without a copy."""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _check, _native
from .errors import CapacityError, InvalidArgumentError, UnsupportedError

# DLPack type codes (dlpack.h).
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6
_KDL_CPU, _KDL_CUDA = 1, 2

_DTYPES = {
    "bool": (_BOOL, 8),
    "int8": (_INT, 8),
    "int16": (_INT, 16),
    "int32": (_INT, 32),
    "int64": (_INT, 64),
    "uint8": (_UINT, 8),
    "uint16": (_UINT, 16),
    "uint32": (_UINT, 32),
    "uint64": (_UINT, 64),
    "float16": (_FLOAT, 16),
    "float32": (_FLOAT, 32),
    "float64": (_FLOAT, 64),
    "bfloat16": (_BFLOAT, 16),
    "complex64": (_COMPLEX, 64),
    "complex128": (_COMPLEX, 128),
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64",
            "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128"}


def dtype_name(dtype: Any) -> str:
    """The canonical name ("float32", "bfloat16", ...) of a torch, NumPy or
    CuPy dtype, or of a name (NumPy's codes such as "f4" too, where NumPy is
    installed)."""
    if dtype is None:
        raise TypeError("dtype is required (a torch, NumPy or CuPy dtype, or a name such as 'float32')")
    if isinstance(dtype, str):
        name = dtype
        if _ALIASES.get(name, name) not in _DTYPES:
            try:
                import numpy

                name = numpy.dtype(dtype).name
            except Exception:  # noqa: BLE001 - NumPy missing or the name unknown to it
                name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).rsplit(".", 1)[-1]
    elif hasattr(dtype, "name") and isinstance(dtype.name, str):
        name = dtype.name  # numpy.dtype, which CuPy uses too
    else:
        try:
            import numpy

            name = numpy.dtype(dtype).name
        except Exception as e:  # noqa: BLE001 - anything numpy refuses
            raise InvalidArgumentError(f"unknown dtype {dtype!r}") from e
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise InvalidArgumentError(f"unsupported dtype {dtype!r}: one of {sorted(_DTYPES)}")
    return name


def _device(device: Any) -> Optional[int]:
    """A CUDA ordinal, or None for host memory."""
    if device is None:
        return 0
    if isinstance(device, bool):
        raise TypeError(f"device must be 'cuda', 'cuda:N', an int or 'cpu', not {device!r}")
    if isinstance(device, int):
        return _check.integer("device", device)
    if not isinstance(device, str):
        kind = getattr(device, "type", None)
        if kind == "cpu":
            return None
        if kind == "cuda":
            index = getattr(device, "index", None)
            return 0 if index is None else int(index)
        device = str(device)
    if device == "cpu":
        return None
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise InvalidArgumentError(f"device {device!r}: 'cuda', 'cuda:N', an int or 'cpu'")


def _current_stream(device: int) -> int:
    """The current CUDA stream of the array library in use (PyTorch if
    loaded, else CuPy), as a DLPack stream handle (1: the legacy default)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        handle = int(torch.cuda.current_stream(device).cuda_stream)
        return handle or 1
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with cupy.cuda.Device(device):
            handle = int(cupy.cuda.get_current_stream().ptr)
        return handle or 1
    return 1


class GrowableTensor:
    """A tensor of ``dtype`` that grows along its first dimension up to
    ``max_size`` (an int: a 1-D tensor of that many elements at most; a
    shape: rows of ``max_size[1:]``, ``max_size[0]`` of them at most),
    on ``device`` ("cuda", "cuda:N", an int, a ``torch.device``, or "cpu"
    for host memory, Linux).

    Growing maps memory at the end of the range: the data stays, nothing is
    copied, and ``data_ptr()`` never changes, so views taken earlier (and
    CUDA graphs that captured the address) stay valid. ``tensor`` is a
    PyTorch view of the current length; ``numpy()`` and ``cupy()`` the same
    for those libraries; any DLPack consumer takes it directly.

    Stream order: ``append`` writes on the current stream of the library
    that owns the appended array and records it; a consumer on another
    stream waits for it (DLPack's ``stream`` argument). Memory is given back
    only by ``shrink_to_fit``, past the length and past every view still
    alive, after the recorded work has finished: to the driver, or with
    ``pooled=True`` to vmmbuf's chunk pool, where the next growth of any
    pooled buffer on the device takes it without a driver call.
    """

    def __init__(self, dtype: Any, max_size: Union[int, Sequence[int]], device: Any = "cuda",
                 *, pooled: bool = False) -> None:
        self.dtype_name = dtype_name(dtype)
        pooled = _check.flag("pooled", pooled)
        if isinstance(max_size, (list, tuple)):
            if not max_size:
                raise InvalidArgumentError("max_size () names no dimension")
            shape: Tuple[int, ...] = tuple(
                _check.integer(f"max_size[{i}]", n, minimum=1) for i, n in enumerate(max_size)
            )
        else:
            try:
                shape = (_check.integer("max_size", max_size, minimum=1),)
            except TypeError:
                raise TypeError(
                    f"max_size must be an int (elements) or a tuple of ints (a shape), "
                    f"not {type(max_size).__name__} ({max_size!r})"
                ) from None
        self.row_shape: Tuple[int, ...] = shape[1:]
        self.max_rows: int = shape[0]
        code, bits = _DTYPES[self.dtype_name]
        self._code, self._bits = code, bits
        self.itemsize: int = bits // 8
        self._row_elems = math.prod(self.row_shape)
        self.row_bytes: int = self._row_elems * self.itemsize
        total = self.max_rows * self.row_bytes
        if total > _check.MAX_BYTES:
            raise InvalidArgumentError(
                f"max_size {max_size!r} of {self.dtype_name} is {_check.size(total)}: more than "
                f"any address space ({_check.size(_check.MAX_BYTES)} at most)"
            )
        self.device: Optional[int] = _device(device)
        self._buf = _native.Buffer(self.max_rows * self.row_bytes, self.device, pooled)
        # Per library, a view of every mapped row and the rows it covers:
        # append writes through it instead of exporting a view per call.
        self._wide: Dict[str, Any] = {}
        _LIVE.add(self)

    # Sizes ---------------------------------------------------------------
    def __len__(self) -> int:
        """Rows in use."""
        return len(self._buf) // self.row_bytes

    @property
    def shape(self) -> Tuple[int, ...]:
        """The current shape: ``(len(self), *row_shape)``."""
        return (len(self),) + self.row_shape

    @property
    def capacity(self) -> int:
        """Rows mapped (growth up to here maps nothing)."""
        return self._buf.capacity // self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes in use."""
        return len(self._buf)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of memory mapped (given back by ``shrink_to_fit``)."""
        return self._buf.capacity

    def data_ptr(self) -> int:
        """The base address: the same for the tensor's whole life."""
        return self._buf.base

    # Growth ----------------------------------------------------------------
    def resize(self, rows: int) -> None:
        """Sets the length to ``rows``: growing keeps the data (new rows are
        uninitialised), shrinking keeps the memory for regrowth. Raises
        ``CapacityError`` past ``max_size`` and ``OutOfMemoryError`` when the
        device is full; either way nothing changed."""
        rows = _check.integer("rows", rows)
        if rows > self.max_rows:
            raise CapacityError(f"{rows} rows do not fit in max_size {self.max_rows}")
        self._buf.resize(rows * self.row_bytes)

    def append(self, rows: Any) -> int:
        """Appends ``rows`` (an array of shape ``row_shape`` or ``(k,
        *row_shape)``, from PyTorch, CuPy or NumPy) by copying them in at the
        end; returns the index of the first new row. The copy runs on the
        current stream of the array's library and is recorded. On any
        failure the length is as before."""
        lib = _library(rows)
        got = dtype_name(rows.dtype)
        if got != self.dtype_name:
            # The rule: no conversion. A float into an int tensor would
            # truncate or wrap (NaN into int is undefined), and a wider
            # type would lose digits silently.
            raise InvalidArgumentError(
                f"append: rows of {got} into a tensor of {self.dtype_name}; "
                f"convert them first (for example rows.astype('{self.dtype_name}') or "
                f"rows.to(torch.{self.dtype_name}))"
            )
        shape = tuple(rows.shape)
        if shape == self.row_shape:
            k, block = 1, rows.reshape((1,) + self.row_shape)
        elif shape[1:] == self.row_shape and len(shape) == len(self.row_shape) + 1:
            k, block = shape[0], rows
        else:
            raise InvalidArgumentError(f"rows of shape {shape} for rows of shape {self.row_shape}")
        at = len(self)
        self.resize(at + k)
        try:
            view = self._wide_view(lib)
            view[at:at + k] = block
            if self.device is not None:
                self._buf.record_write(_current_stream(self.device))
        except BaseException:
            self.resize(at)
            raise
        return at

    def shrink_to_fit(self) -> None:
        """Gives back the memory past the length and past every live view,
        once the work recorded on it (and queued on the current stream) has
        finished."""
        stream = None if self.device is None else _current_stream(self.device)
        self._wide.clear()  # the cached views cover the capacity
        self._buf.shrink_to_fit(stream)

    # Views -----------------------------------------------------------------
    @property
    def tensor(self) -> Any:
        """A PyTorch tensor over the current length (no copy)."""
        import torch

        return torch.from_dlpack(self)

    def numpy(self) -> Any:
        """A NumPy array over the current length (host memory only)."""
        import numpy

        return numpy.from_dlpack(self)

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any:
        """NumPy's array protocol (``np.asarray(t)``): the rows, without a
        copy, for a tensor in host memory; ``dtype`` converts (a copy) and
        ``copy=True`` copies. A tensor on the GPU has no NumPy array:
        :class:`~vmmbuf.errors.UnsupportedError` says what to use."""
        if self.device is not None:
            raise UnsupportedError(
                "np.asarray of a GrowableTensor on the GPU: NumPy reads host memory only "
                "(use .tensor or .cupy, or make it with device='cpu')")
        view = self.numpy()
        if dtype is not None and view.dtype != dtype:
            return view.astype(dtype)
        return view.copy() if copy else view

    def cupy(self) -> Any:
        """A CuPy array over the current length (no copy)."""
        import cupy

        return cupy.from_dlpack(self)

    def _wide_view(self, lib: str) -> Any:
        """A view of every mapped row in ``lib``, cached until the capacity
        changes (or ``shrink_to_fit``)."""
        rows = self.capacity
        cached = self._wide.get(lib)
        if cached is not None and cached[0] == rows:
            return cached[1]
        self._wide.pop(lib, None)
        stream = None if self.device is None else -1  # appends order their own writes

        def make(versioned: bool) -> Any:
            return self._export(rows, stream, versioned)

        if lib == "torch":
            import torch.utils.dlpack as mod
        elif lib == "cupy":
            import cupy as mod  # type: ignore[no-redef]
        else:
            import numpy as mod  # type: ignore[no-redef]
        view = mod.from_dlpack(_Exporter(make, self.__dlpack_device__()))
        self._wide[lib] = (rows, view)
        return view

    def _export(self, rows: int, stream: Optional[int], versioned: bool) -> Any:
        strides = []
        step = 1
        for n in reversed(self.row_shape):
            strides.append(step)
            step *= n
        strides = [step] + list(reversed(strides))
        return self._buf.export(0, [rows, *self.row_shape], strides, self._code, self._bits, 1,
                                stream, versioned)

    # DLPack ----------------------------------------------------------------
    def __dlpack_device__(self) -> Tuple[int, int]:
        """(kDLCUDA, ordinal) or (kDLCPU, 0)."""
        return (_KDL_CPU, 0) if self.device is None else (_KDL_CUDA, self.device)

    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule over the current length. ``stream``: the
        consumer's CUDA stream (None: the legacy default stream; -1: no
        ordering), which waits for the recorded writes. Versioned (DLPack
        1.1) when ``max_version`` allows it. Never copies: ``copy=True`` or
        another ``dl_device`` raises ``BufferError``."""
        if copy:
            raise BufferError("a GrowableTensor is exported without a copy; copy=True is refused")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"dl_device {dl_device} differs from the tensor's {self.__dlpack_device__()}")
        if self.device is None:
            if stream not in (None, -1):
                raise BufferError(f"stream {stream} for host memory")
            stream = None
        elif stream is None:
            stream = 1
        elif stream == 0:
            raise BufferError("stream 0 is ambiguous in DLPack: 1 is the legacy default stream")
        versioned = max_version is not None and max_version[0] >= 1
        return self._export(len(self), stream, versioned)

    def __repr__(self) -> str:
        where = "cpu" if self.device is None else f"cuda:{self.device}"
        return (f"GrowableTensor(shape={self.shape}, dtype={self.dtype_name}, device={where}, "
                f"capacity={self.capacity} of {self.max_rows} rows, data_ptr={self.data_ptr():#x})")


class _Exporter:
    """Hands a library's ``from_dlpack`` the capsule ``make`` makes (the
    versioned kind if the library asks for it: NumPy makes arrays from the
    legacy kind read-only)."""

    def __init__(self, make: Any, device: Tuple[int, int]) -> None:
        self._make, self._device = make, device

    def __dlpack__(self, *, max_version: Optional[Tuple[int, int]] = None, **_: Any) -> Any:
        return self._make(max_version is not None and max_version[0] >= 1)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._device


# Every live GrowableTensor, for vmmbuf.stats() (weak: stats keep none alive).
_LIVE: "weakref.WeakSet[GrowableTensor]" = weakref.WeakSet()


def figures(device: Optional[int]) -> Dict[str, Any]:
    """What the live GrowableTensors on ``device`` (None: host memory) hold,
    under the keys ``vmmbuf.stats()`` reports; empty if there are none."""
    mine = [t for t in list(_LIVE) if t.device == device]
    if not mine:
        return {}
    return {
        "growable_tensors": len(mine),
        "growable_bytes": sum(t.nbytes for t in mine),
        "growable_mapped_bytes": sum(t.mapped_bytes for t in mine),
    }


def _library(array: Any) -> str:
    """Which library ("torch", "cupy", "numpy") owns ``array``."""
    module = type(array).__module__.split(".", 1)[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    raise UnsupportedError(f"append takes a torch, cupy or numpy array, not {type(array)!r}")


__all__ = ["GrowableTensor", "dtype_name"]
