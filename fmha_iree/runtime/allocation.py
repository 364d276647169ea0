"""How a device's buffers are allocated between calls (the lowest layer, with ``device``).

IREE 3.13's CUDA HAL allocates a call's results from a stream-ordered pool (``cuMemPoolCreate``)
whose release threshold it leaves at 0: the pool hands its free memory back to the driver at
each synchronization, which its semaphores make after every call, and maps it again for the
next one. On the H200 that held the host on every call with the GPU idle, longer than the GPU work
for a group-mode decode (a 1.1 GB frame; ``docs/BENCHMARKS.md``, "Device memory between calls: kept
buffers on CUDA"). The threshold cannot be set from outside IREE, so on CUDA fmha_iree turns the
stream-ordered allocations off (``--cuda_async_allocations=false``) and wraps the device's allocator
in IREE's caching allocator: a released buffer is kept and handed out again for a request of exactly
its size (ragged frames round their key counts, ``frames.frame_keys``, so a decode loop repeats its
sizes).

IREE's cache only bounds the count of kept buffers; a :class:`CacheKeeper` per device bounds
their bytes: after each call it reads the allocator's statistics and returns every kept buffer
to the driver (one synchronization) once the device's allocations have grown by more than the
budget since the last return, or once many calls have missed the cache (a full cache would free
each new buffer at once). An out-of-memory failure also returns them (``device.exhausted``).
"""

from __future__ import annotations

import dataclasses
import os
import threading

__all__ = ["CUDA_CACHE_ENV", "CUDA_CACHE_DEFAULT", "AllocatorPolicy", "allocator_policy", "CacheKeeper"]

CUDA_CACHE_ENV = "FMHA_IREE_CUDA_CACHE_BYTES"
# bytes of released buffers a CUDA device keeps beyond its live ones: two decode frames of the
# H200 group-mode benchmark (1.1 GB each) and their LSE variants fit
CUDA_CACHE_DEFAULT = 4 << 30
_KEPT = 1024  # IREE's limit on kept buffers (its free list)
_MISSES = _KEPT // 2  # calls that allocated anew before the kept buffers are returned


@dataclasses.dataclass(frozen=True)
class AllocatorPolicy:
    """How a device is opened: IREE runtime flags to set (process-wide, read when the device's
    driver is first created), allocator specs wrapping its allocator
    (``HalDriver.create_device_by_uri(allocators=...)``) and the bytes its :class:`CacheKeeper`
    lets the kept buffers grow by (0: no keeper)."""

    flags: tuple[str, ...] = ()
    allocators: tuple[str, ...] = ()
    budget: int = 0


def allocator_policy(uri: str, environ=None) -> AllocatorPolicy:
    """The policy for ``uri``: CUDA devices keep released buffers (``$FMHA_IREE_CUDA_CACHE_BYTES``
    bytes beyond the live ones, default 4 GiB; 0 keeps IREE's stream-ordered pools), with IREE's
    stream-ordered allocations off unless ``$IREE_PY_RUNTIME_FLAGS`` sets
    ``--cuda_async_allocations`` itself; other devices keep IREE's defaults (HIP's pools keep
    their memory already: ``--hip_async_caching``)."""
    environ = os.environ if environ is None else environ
    if uri.split(":", 1)[0] != "cuda":
        return AllocatorPolicy()
    raw = environ.get(CUDA_CACHE_ENV, "").strip()
    try:
        budget = int(raw) if raw else CUDA_CACHE_DEFAULT
    except ValueError:
        raise ValueError(f"${CUDA_CACHE_ENV} must be a byte count, got {raw!r}") from None
    if budget < 0:
        raise ValueError(f"${CUDA_CACHE_ENV} must be >= 0, got {budget}")
    if budget == 0:
        return AllocatorPolicy()
    user = "cuda_async_allocations" in environ.get("IREE_PY_RUNTIME_FLAGS", "")
    return AllocatorPolicy(() if user else ("--cuda_async_allocations=false",),
                           (f"caching:device_local=*;*;{_KEPT}",), budget)


class CacheKeeper:
    """Bounds what a caching allocator keeps (see the module docstring): ``after_call`` runs after
    each call on the device."""

    def __init__(self, allocator, budget: int, misses: int = _MISSES):
        self.allocator, self.budget, self.misses = allocator, budget, misses
        self._lock = threading.Lock()
        self._stats = bool(getattr(allocator, "has_statistics", False))
        self._allocated, self._base = self._read()
        self._missed, self.trims = 0, 0

    def _read(self) -> tuple[int, int]:
        """(bytes allocated so far, bytes held now: live and kept) by the allocator; (0, 0)
        where it keeps no statistics."""
        if not self._stats:
            return 0, 0
        s = self.allocator.statistics
        return s["device_bytes_allocated"], s["device_bytes_allocated"] - s["device_bytes_freed"]

    def after_call(self):
        """Return the kept buffers to the driver when they may exceed the budget."""
        with self._lock:
            allocated, held = self._read()
            self._missed += 1 if (allocated > self._allocated or not self._stats) else 0
            self._allocated = allocated
            if held > self._base + self.budget or self._missed >= self.misses:
                self._trim()

    def trim(self):
        """Return every kept buffer to the driver now."""
        with self._lock:
            self._trim()

    def _trim(self):
        self.allocator.trim()
        self._allocated, self._base = self._read()
        self._missed, self.trims = 0, self.trims + 1
