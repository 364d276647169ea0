"""IREE devices and the arrays that live on them: the lowest layer of the runtime.

Needs only ``iree-base-runtime`` and numpy. Devices are opened once per process
(:data:`DEVICES`); a :class:`DeviceTensor` holds a buffer on one of them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import numpy as np

from .allocation import AllocatorPolicy, CacheKeeper, allocator_policy

__all__ = ["DeviceRegistry", "DEVICES", "get_device", "DeviceTensor", "host_buffer", "element_type", "exhausted", "memory_errors",
           "HOST_DTYPES"]


class DeviceRegistry:
    """The IREE HAL devices this process opened, one per URI (IREE devices are costly to create
    and hold the allocator pools every call reuses), each opened with its
    :func:`allocation.allocator_policy` and, where that keeps released buffers, a
    :class:`allocation.CacheKeeper`."""

    def __init__(self):
        self._devices: dict = {}
        self._keepers: dict = {}
        self._lock = threading.Lock()

    def get(self, uri: str):
        """The device for ``uri``, opened on first use; ``ValueError`` naming it if it cannot be."""
        with self._lock:
            dev = self._devices.get(uri)
            if dev is None:
                policy = allocator_policy(uri)
                dev = self._devices[uri] = _open(uri, policy)
                if policy.budget:
                    self._keepers[uri] = CacheKeeper(dev.allocator, policy.budget)
            return dev

    def keeper(self, uri: str) -> CacheKeeper | None:
        """The keeper of ``uri``'s device (None where released buffers are not kept)."""
        with self._lock:
            return self._keepers.get(uri)

    def trim(self, uri: str):
        """Return the buffers ``uri``'s device keeps to the driver (after an out-of-memory
        failure, so that the next call can use them)."""
        keeper = self.keeper(uri)
        if keeper is not None:
            with contextlib.suppress(Exception):
                keeper.trim()


def _open(uri: str, policy: AllocatorPolicy):
    import iree.runtime as rt

    try:
        if not policy.allocators:
            return rt.get_device(uri)
        if policy.flags:
            _warn_if_driver_exists(uri)
            rt.flags.parse_flags(*policy.flags)  # read when the driver is created (first use)
        return rt.get_driver(uri).create_device_by_uri(uri, allocators=list(policy.allocators))
    except Exception as e:  # the runtime raises ValueError/RuntimeError variants
        raise ValueError(f"device {uri!r} could not be opened: {e}") from None


def _warn_if_driver_exists(uri: str) -> None:
    """Warn where IREE's own device for ``uri``'s driver was opened before fmha_iree's (through
    ``iree.runtime.get_device``): the driver then keeps the flags it was created with, IREE's
    stream-ordered allocations stay on beside fmha_iree's caching allocator, and the pool's trim
    at every synchronization cost group-mode prefill 2.1-2.5x its time on an H100
    (docs/BENCHMARKS.md, "A serving process and the order its devices were opened")."""
    import warnings

    try:
        from iree.runtime import system_setup
    except ImportError:
        return
    driver = uri.split(":", 1)[0]
    opened = getattr(system_setup, "_GLOBAL_DEVICES_BY_URI", {})
    if any(str(key).split(":", 1)[0] == driver for key in list(opened)):
        warnings.warn(f"fmha_iree opens {uri!r} after IREE's own {driver} device was opened in this process: the "
                      f"driver keeps IREE's stream-ordered allocations, which made fmha_iree's calls up to 2.5x "
                      f"slower; open fmha_iree's device first (fmha_iree.to_device / load before iree.runtime."
                      f"get_device) or set IREE_PY_RUNTIME_FLAGS=--cuda_async_allocations=false before either",
                      RuntimeWarning, stacklevel=4)


DEVICES = DeviceRegistry()


def get_device(uri: str):
    """The IREE HAL device for ``uri`` (:data:`DEVICES`)."""
    return DEVICES.get(uri)


_EXHAUSTED = ("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY", "out of memory")


def exhausted(e: RuntimeError, uri: str, what: str) -> MemoryError | None:
    """A ``MemoryError`` naming the device and what needed the memory, to raise from ``e``, where
    IREE reported an out-of-memory failure (a RuntimeError carrying ``RESOURCE_EXHAUSTED``); else
    None. The device's cached free memory is returned to the driver, so it stays usable for
    calls that fit."""
    if any(s in str(e) for s in _EXHAUSTED):
        DEVICES.trim(uri)
        return MemoryError(f"device {uri!r} ran out of memory for {what}: {str(e)[:300]}")
    return None


@contextlib.contextmanager
def memory_errors(uri: str, what: str):
    """Raise the runtime's out-of-memory failures inside the block as ``MemoryError`` (see
    :func:`exhausted`)."""
    try:
        yield
    except RuntimeError as e:
        err = exhausted(e, uri, what)
        if err is None:
            raise
        raise err from e


HOST_DTYPES = {"f16": np.float16, "bf16": np.int16, "f32": np.float32, "i32": np.int32}


@functools.lru_cache(maxsize=None)
def element_type(dtype: str, typed_bf16: bool = True):
    import iree.runtime as rt

    if dtype == "bf16":
        return rt.HalElementType.BFLOAT_16 if typed_bf16 else rt.HalElementType.SINT_16
    return {"f16": rt.HalElementType.FLOAT_16, "f32": rt.HalElementType.FLOAT_32,
            "i32": rt.HalElementType.SINT_32}[dtype]


# DLPack device type codes (dlpack.h): CPU, CUDA, ROCm
_DLPACK_CODES = {"local-task": 1, "local-sync": 1, "cuda": 2, "hip": 10}
DLPACK_DTYPES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32", "torch.int32": "i32",
                 "float16": "f16", "float32": "f32", "int32": "i32"}  # torch and numpy spellings


def dlpack_device(uri: str) -> tuple[int, int]:
    """(DLPack device type, device index) of an IREE device URI."""
    driver, _, index = uri.partition("://")
    return _DLPACK_CODES[driver], int(index or 0)


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is 64-byte aligned, so that CPU drivers read
    it in place (:meth:`DeviceTensor.from_host_view`); numpy aligns large arrays to 16 only."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    buf = np.empty(n + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    return buf[off:off + n].view(dt).reshape(shape)


def host_buffer(a: np.ndarray):
    """``a``'s bytes in a new IREE ``VmBuffer`` (a module's ``!util.buffer`` argument, read by its
    host code; at least 8 bytes)."""
    import iree.runtime as rt

    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    buf = rt.VmBuffer(max(raw.size, 8), alignment=64, mutable=True)
    np.frombuffer(memoryview(buf), np.uint8)[:raw.size] = raw
    return buf


class DeviceTensor:
    """An array that lives on an IREE device (see :func:`fmha_iree.to_device`).

    Inputs given as DeviceTensors are read where they are, and results come back as DeviceTensors
    (nothing crosses the host bus); ``to_numpy`` / ``to_torch`` copy to the host. bf16 data is
    typed bf16 on the device; numpy sees its bits as int16. DLPack both ways, without copies:
    :meth:`from_dlpack` wraps another library's tensor, and ``torch.from_dlpack(t)`` (or any
    DLPack consumer) views a DeviceTensor's memory.
    """

    def __init__(self, device_uri: str, buffer, shape, dtype: str, ready=None):
        self.device_uri = device_uri
        self._buffer = buffer  # HalBuffer, shared by reshaped views
        self.shape = tuple(int(x) for x in shape)
        self.dtype = dtype
        # HalFence reached once the contents are written (results of asynchronous calls; None:
        # ready now). Reading it (to_numpy, or as the input of another call) waits for it first.
        self.ready = ready
        self._views: dict = {}
        self._reshaped: dict = {}  # views by shape (reshape)
        self._owner = None  # the tensor whose memory a DLPack import shares (kept alive with it)

    @classmethod
    def from_host(cls, array: np.ndarray, dtype: str, device_uri: str) -> "DeviceTensor":
        import iree.runtime as rt

        dev = get_device(device_uri)
        a = np.ascontiguousarray(array)
        with memory_errors(device_uri, f"a {list(a.shape)} {dtype} upload"):
            bv = dev.allocator.allocate_buffer_copy(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                    allowed_usage=rt.BufferUsage.DEFAULT, device=dev, buffer=a,
                                                    element_type=element_type(dtype))
        return cls(device_uri, bv.get_buffer(), a.shape, dtype)

    @classmethod
    def from_host_view(cls, array: np.ndarray, dtype: str, device_uri: str) -> "DeviceTensor":
        """``array`` for a call on ``device_uri``: its own memory where the device reads host memory
        (CPU drivers) and ``array`` is C-contiguous and 64-byte aligned (IREE's rule for imported
        host buffers; torch's CPU allocator aligns so), else a copy (:meth:`from_host`). The caller
        leaves ``array`` unchanged until the call that reads it has finished."""
        a = np.ascontiguousarray(array)
        if dlpack_device(device_uri)[0] != 1 or a.ctypes.data % 64 or a.size == 0:
            return cls.from_host(a, dtype, device_uri)
        with memory_errors(device_uri, f"a {list(a.shape)} {dtype} import"):
            bv = get_device(device_uri).from_dlpack_capsule(a.__dlpack__())
        t = cls(device_uri, bv.get_buffer(), a.shape, dtype)
        t._owner = a
        return t

    @classmethod
    def from_dlpack(cls, x, device_uri: str = "local-task") -> "DeviceTensor":
        """A DeviceTensor sharing ``x``'s memory (no copy): ``x`` is a torch tensor (or any DLPack
        producer) on the device ``device_uri`` names (CPU tensors for ``local-task``), C-contiguous,
        of dtype float16, bfloat16, float32 or int32. Writes to ``x`` show through; ``x`` is kept
        alive while the DeviceTensor is. The caller orders ``x``'s pending writes before the call
        that reads it (e.g. ``torch.cuda.current_stream().synchronize()``)."""
        dtype = DLPACK_DTYPES.get(str(getattr(x, "dtype", None)))
        if dtype is None:
            raise TypeError(f"x has dtype {getattr(x, 'dtype', type(x).__name__)}; DLPack import takes float16, "
                            "bfloat16, float32 or int32")
        if hasattr(x, "is_contiguous") and not x.is_contiguous():
            raise ValueError("x must be contiguous for a DLPack import (call .contiguous() first)")
        if hasattr(x, "__dlpack_device__") and tuple(x.__dlpack_device__())[0] != dlpack_device(device_uri)[0]:
            raise ValueError(f"x lives on DLPack device {tuple(x.__dlpack_device__())}, not on {device_uri!r}")
        return cls.from_capsule(x.__dlpack__(), device_uri, tuple(x.shape), dtype, x)

    @classmethod
    def from_capsule(cls, capsule, device_uri: str, shape, dtype: str, owner) -> "DeviceTensor":
        """A DeviceTensor sharing the memory of the DLPack ``capsule`` of ``owner`` (kept alive
        with it), whose device, dtype (``dtype``), shape and contiguity the caller has checked:
        :meth:`from_dlpack` without the checks, for calls that import tensors on every call
        (``torch_gpu``)."""
        bv = get_device(device_uri).from_dlpack_capsule(capsule)
        t = cls(device_uri, bv.get_buffer(), shape, dtype)
        if bv.element_type == int(element_type(dtype)):
            t._views[True] = bv
        t._owner = owner
        return t

    def __dlpack_device__(self) -> tuple[int, int]:
        return dlpack_device(self.device_uri)

    def __dlpack__(self, stream=None):
        """A DLPack capsule viewing this tensor's memory (waits for its contents first)."""
        self.wait()
        try:
            return get_device(self.device_uri).create_dlpack_capsule(self.buffer_view(), *dlpack_device(self.device_uri))
        except RuntimeError as e:  # IREE 3.13's CUDA HAL cannot export its stream-ordered pool allocations
            raise TypeError(f"this tensor's memory on {self.device_uri!r} cannot be exported through DLPack "
                            f"({str(e)[:160]}); copy it with .to_torch()") from e

    @classmethod
    def from_result(cls, bv, dtype: str, device_uri: str, ready=None) -> "DeviceTensor":
        """Wrap a function result (a HalBufferView), ready at the fence ``ready``."""
        return cls(device_uri, bv.get_buffer(), bv.shape, dtype, ready)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, shape) -> "DeviceTensor":
        """The same memory with ``shape`` (made once per shape: a call repeated on this tensor
        reuses the view and its buffer view)."""
        shape = tuple(int(x) for x in shape)
        view = self._reshaped.get(shape)
        if view is None:
            if math.prod(shape) != math.prod(self.shape):
                raise ValueError(f"cannot reshape {list(self.shape)} to {list(shape)}")
            view = DeviceTensor(self.device_uri, self._buffer, shape, self.dtype, self.ready)
            view._owner = self._owner
            if len(self._reshaped) < 8:
                self._reshaped[shape] = view
        return view

    def buffer_view(self, typed_bf16: bool = True):
        """The tensor as a HalBufferView (made once per element typing)."""
        bv = self._views.get(typed_bf16)
        if bv is None:
            import iree.runtime as rt

            bv = self._views[typed_bf16] = rt.HalBufferView(self._buffer, list(self.shape),
                                                            element_type(self.dtype, typed_bf16))
        return bv

    def wait(self) -> "DeviceTensor":
        """Block until the contents are written (results of asynchronous calls); returns self."""
        if self.ready is not None:
            with memory_errors(self.device_uri, "the call that writes this tensor"):
                self.ready.wait()
        return self

    def to_numpy(self) -> np.ndarray:
        import iree.runtime as rt

        self.wait()
        arr = rt.DeviceArray(get_device(self.device_uri), self.buffer_view(typed_bf16=False))
        return np.array(arr.to_host(), copy=True).view(HOST_DTYPES[self.dtype]).reshape(self.shape)

    def to_torch(self):
        import torch

        t = torch.from_numpy(self.to_numpy())
        return t.view(torch.bfloat16) if self.dtype == "bf16" else t

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device_uri!r})"
