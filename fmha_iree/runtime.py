"""Runtime: load compiled FMHA modules on an IREE device and execute a plan through them.

Needs only ``iree-base-runtime`` and numpy (no torch, no compiler), so modules compiled elsewhere
can be deployed with this file alone (see :func:`load`).
"""

from __future__ import annotations

import threading

import numpy as np

from .plan import Plan

__all__ = ["get_device", "FmhaModule", "DeployedFmha", "load"]

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
            # to_host() may map the device buffer itself (CPU drivers); the allocator reuses it
            # in later calls, so hand the caller its own copy.
            return np.array(out.to_host(), copy=True), np.array(lse.to_host(), copy=True)


class DeployedFmha:
    """A module compiled ahead of time (``fmha-iree compile``), loaded with its manifest.

    Call it like :func:`fmha_iree.fmha_fwd` without ``layout``/``tiles``/``device`` (fixed by the
    module); inputs are checked against the manifest before anything runs.
    """

    def __init__(self, manifest: dict, module: FmhaModule):
        from .tiles import TileConfig

        self.manifest = manifest
        self.module = module
        t = manifest["tiles"]
        ck = t["ck"]
        self.tiles = TileConfig(ck["kM0"], ck["kN0"], ck["kK0"], ck["kN1"], ck["kK1"], kv_chunk=t["kv_chunk"])

    def __call__(self, q, k, v, *, mask=None, scale=None, return_lse=False, cu_seqlen_q=None, cu_seqlen_k=None):
        from .api import run_batch
        from .spec import check_batch

        pr = self.manifest["problem"]
        if mask is None:
            mask = pr.get("mask")
        p = check_batch(q, k, v, mask=mask, scale=scale, layout=pr["layout"], cu_seqlen_q=cu_seqlen_q,
                        cu_seqlen_k=cu_seqlen_k)
        if p.q.dtype != pr["dtype"]:
            raise TypeError(f"q has dtype {p.q.dtype} but the module was compiled for {pr['dtype']}")
        if p.hq // p.hk != pr["group"]:
            raise ValueError(f"q/k heads {p.hq}/{p.hk} give a group of {p.hq // p.hk}; the module expects {pr['group']}")
        if (p.dq, p.dv) != (pr["hdim"], pr["hdim_v"]):
            raise ValueError(f"head dims q/k {p.dq}, v {p.dv} differ from the module's {pr['hdim']}, {pr['hdim_v']}")
        for key, have in (("heads", p.hq), ("kv_heads", p.hk)):
            if pr.get(key) not in (None, have):
                raise ValueError(f"{'q' if key == 'heads' else 'k'} has {have} heads; the module was compiled for {pr[key]}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        return run_batch(p, return_lse, self.tiles, lambda: self.module, self.manifest["target"]["family"])


def load(path, device: str = "local-task") -> DeployedFmha:
    """Load ``path`` (a ``.vmfb`` written by ``fmha-iree compile``) and its ``.json`` manifest on
    ``device``. Needs only ``iree-base-runtime`` and numpy."""
    import json
    from pathlib import Path

    from .targets import resolve_device

    path = Path(path)
    manifest = json.loads(path.with_suffix(".json").read_text())
    uri, _ = resolve_device(device)
    return DeployedFmha(manifest, FmhaModule(path.read_bytes(), uri, manifest["module"]))
