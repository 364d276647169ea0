"""Small per-call arrays (a ragged call's index table) uploaded without the host waiting.

``HalAllocator.allocate_buffer_copy`` copies synchronously and allocates each time: on the H200
(IREE 3.13) an upload of a small table took longer than the call it feeds (docs/tried.md, "A
group-mode replay's index table uploaded once to the device"). A
:class:`UploadRing` keeps a few slots, each a pinned host buffer mapped once and a device buffer
of the same size: an upload writes the host side, queues a copy on the device's queue and returns
the device buffer with the copy's fence, which the call then waits on (on the device). A slot is
written again only after its last copy has run (host side) and is copied into only after the
call that read it has finished (device side, a queue wait).

On devices whose queue is one in-order stream (IREE's CUDA and HIP HALs) the call does not wait on
the copy's fence: stream order already puts the copy first, and those HALs wait for a call's
fences on the host before allocating its results (``queue_alloca`` blocks on its wait
semaphores), so with the copy queued behind the previous call the host waited for that call to
finish (a B32 decode held the host far longer behind a running call than with the GPU idle on the
H200: docs/tried.md, "Why the host waited"). There the slot's reuse waits on the host instead, for
the call that read it eight calls before.
"""

from __future__ import annotations

import threading

import numpy as np

from .device import get_device

__all__ = ["UploadRing"]

_IN_ORDER = ("cuda", "hip")  # device URI schemes whose HAL queue is one in-order stream


class _Slot:
    def __init__(self):
        self.host = self.mapped = self.dev = self.view = None
        self.capacity = 0
        self.copied = None  # fence: the last copy out of the host buffer
        self.read = None  # fence: the last call that read the device buffer

    def grow(self, device, words: int):
        import iree.runtime as rt

        for f in (self.copied, self.read):
            if f is not None:
                f.wait()
        cap = 1 << max(10, (words - 1).bit_length())
        host_type = rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE
        usage = rt.BufferUsage.TRANSFER | rt.BufferUsage.MAPPING
        self.host = device.allocator.allocate_buffer(memory_type=host_type, allowed_usage=usage, allocation_size=4 * cap)
        self.mapped = self.host.map().asarray([cap], np.dtype(np.int32))
        self.dev = device.allocator.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                    allowed_usage=rt.BufferUsage.DEFAULT, allocation_size=4 * cap)
        self.view = self.dev.create_view(rt.Shape([cap]), 4)
        self.capacity, self.copied, self.read = cap, None, None


class UploadRing:
    """``slots`` staging slots on the device ``device_uri`` (see the module docstring)."""

    def __init__(self, device_uri: str, slots: int = 8):
        self.device_uri = device_uri
        self.in_order = device_uri.split(":", 1)[0] in _IN_ORDER
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._lock = threading.Lock()

    def put(self, a: np.ndarray):
        """Queue ``a`` (int32, 1-D) for the device: returns (buffer view of at least ``a.size``
        int32, the fence the reading call must wait on (None on an in-order queue), a callback
        taking the reading call's fence)."""
        import iree.runtime as rt

        device = get_device(self.device_uri)
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot.capacity < a.size:
                slot.grow(device, a.size)
            if slot.copied is not None:
                slot.copied.wait()  # the host buffer is free once the copy out of it has run
            slot.mapped[: a.size] = a
            if self.in_order and slot.read is not None:
                slot.read.wait()  # queued behind nothing: the copy goes on the stream before the call
            wait = rt.HalFence(1) if slot.read is None or self.in_order else slot.read
            done = rt.HalFence.create_at(device.create_semaphore(0), 1)
            device.queue_copy(slot.host, slot.dev, wait, done)
            slot.copied = done

            def read_by(fence, slot=slot):
                slot.read = fence

            return slot.view, None if self.in_order else done, read_by
