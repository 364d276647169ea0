"""Runtime: load compiled FMHA modules on an IREE device and execute a plan through them.

Needs only ``iree-base-runtime`` and numpy (no torch, no compiler), so modules compiled elsewhere
can be deployed with this file alone (see :func:`load`).
"""

from __future__ import annotations

import threading

import numpy as np

from .plan import Plan

__all__ = ["get_device", "FmhaModule"]

_devices: dict = {}
_devices_lock = threading.Lock()


def get_device(uri: str):
    """The IREE HAL device for ``uri`` (created once per process)."""
    import iree.runtime as rt

    with _devices_lock:
        dev = _devices.get(uri)
        if dev is None:
            try:
                dev = rt.get_device(uri)
            except Exception as e:  # the runtime raises ValueError/RuntimeError variants
                raise ValueError(f"device {uri!r} could not be opened: {e}") from None
            _devices[uri] = dev
        return dev


class FmhaModule:
    """A compiled FMHA module (``init`` / ``step`` / ``finalize``, see ``graph.py``) on a device."""

    def __init__(self, vmfb: bytes, device_uri: str, name: str):
        import iree.runtime as rt

        self.device_uri = device_uri
        self.device = get_device(device_uri)
        self._ctx = rt.SystemContext(config=rt.Config(device=self.device))
        self._ctx.add_vm_module(rt.VmModule.copy_buffer(self._ctx.instance, vmfb))
        mod = self._ctx.modules[name]
        self._init, self._step, self._finalize = mod["init"], mod["step"], mod["finalize"]
        self._lock = threading.Lock()

    def _put(self, a: np.ndarray):
        import iree.runtime as rt

        return rt.asdevicearray(self.device, a)

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, hk: int, plan: Plan):
        """Execute ``plan`` on ABI arrays; returns (out, lse) as numpy arrays."""
        with self._lock:
            acc, m, l = self._init(np.zeros((plan.n_tiles, hk), np.int32))
            if plan.calls:
                qd, kd, vd = self._put(q), self._put(k), self._put(v)
                sd = self._put(np.array([scale], np.float32))
            for desc in plan.calls:
                acc, m, l = self._step(qd, kd, vd, sd, acc, m, l, desc)
            out, lse = self._finalize(acc, m, l, plan.out_map, plan.lse_map)
            return out.to_host(), lse.to_host()
