"""Calls prepared once and replayed: a repeated call on DeviceTensors skips validation, planning
and routing, so issuing it costs the host little more than IREE's own call.

A call is keyed by everything its checks and its plan read: the tensors' shapes, dtypes and
devices (never their contents), the other arguments with their types, and for group mode the
metadata arrays' values (``varlen_call_key``: sequence starts and lengths, a paged cache's block
table). A model calls attention once per layer with one batch composition, so every layer after
the first replays the first one's call; a decode step that changes the composition prepares
afresh.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from .device import DeviceTensor

__all__ = ["device_call_key", "varlen_call_key", "PreparedCalls"]


def device_call_key(q, k, v, *rest):
    """A memo key for a call on DeviceTensors: their shapes, dtypes and devices and the other
    arguments ``rest`` with their types (so ``True`` and ``1`` differ); None for any other call,
    or arguments that cannot be keyed."""
    if not (type(q) is type(k) is type(v) is DeviceTensor):
        return None
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device_uri, k.device_uri, v.device_uri,
           *((type(x), x) for x in rest))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _Unkeyed(Exception):
    pass


def _array_key(x):
    """A metadata argument's value as a hashable key (None stays None): numpy arrays, torch CPU
    tensors and lists of ints by dtype, shape and bytes."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        a = x
    elif type(x).__module__.split(".")[0] == "torch" and getattr(getattr(x, "device", None), "type", None) == "cpu":
        a = x.detach().numpy()
    elif isinstance(x, (list, tuple)):
        a = np.asarray(x)
    else:
        raise _Unkeyed
    if a.dtype == object or a.size > (1 << 20):
        raise _Unkeyed
    return a.dtype.str, a.shape, a.tobytes()


def varlen_call_key(q, k, v, arrays, *rest):
    """``device_call_key`` of a call with the values of its metadata ``arrays`` (seqstarts,
    seqlen_k, padded starts, block table, ALiBi slopes: what its plan is made of); None where any
    of them cannot be keyed (e.g. a device array)."""
    key = device_call_key(q, k, v, *rest)
    if key is None:
        return None
    try:
        return key + tuple(_array_key(a) for a in arrays)
    except _Unkeyed:
        return None


class PreparedCalls:
    """Calls on DeviceTensors already validated and routed, by their key (at most ``size``, least
    recently used dropped)."""

    def __init__(self, size: int = 256):
        self._size = size
        self._runs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)

    def get(self, key):
        if key is None:
            return None
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
            return run

    def put(self, key, run):
        if key is None or run is None:
            return
        with self._lock:
            self._runs[key] = run
            while len(self._runs) > self._size:
                self._runs.popitem(last=False)

    def memo(self, key):
        """A callback storing a run under ``key`` (None where the call cannot be keyed)."""
        return None if key is None else (lambda run: self.put(key, run))

    def clear(self):
        with self._lock:
            self._runs.clear()
