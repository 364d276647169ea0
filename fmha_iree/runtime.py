"""Runtime: load compiled FMHA modules on an IREE device and execute a plan through them.

Needs only ``iree-base-runtime`` and numpy (no torch, no compiler), so modules compiled elsewhere
can be deployed with this file alone (see :func:`load`).
"""

from __future__ import annotations

import threading

import numpy as np

from .plan import Plan

__all__ = ["get_device", "DeviceTensor", "FmhaModule", "DeployedFmha", "load"]

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


_HOST_DTYPES = {"f16": np.float16, "bf16": np.int16, "f32": np.float32}


def _element_type(dtype: str, typed_bf16: bool = True):
    import iree.runtime as rt

    if dtype == "bf16":
        return rt.HalElementType.BFLOAT_16 if typed_bf16 else rt.HalElementType.SINT_16
    return {"f16": rt.HalElementType.FLOAT_16, "f32": rt.HalElementType.FLOAT_32}[dtype]


class DeviceTensor:
    """An array that lives on an IREE device (see :func:`fmha_iree.to_device`).

    Inputs given as DeviceTensors are read where they are, and results come back as DeviceTensors
    (nothing crosses the host bus); ``to_numpy`` / ``to_torch`` copy to the host. bf16 data is
    typed bf16 on the device; numpy sees its bits as int16.
    """

    def __init__(self, device_uri: str, buffer, shape, dtype: str):
        self.device_uri = device_uri
        self._buffer = buffer  # HalBuffer, shared by reshaped views
        self.shape = tuple(int(x) for x in shape)
        self.dtype = dtype

    @classmethod
    def from_host(cls, array: np.ndarray, dtype: str, device_uri: str) -> "DeviceTensor":
        import iree.runtime as rt

        dev = get_device(device_uri)
        a = np.ascontiguousarray(array)
        bv = dev.allocator.allocate_buffer_copy(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                allowed_usage=rt.BufferUsage.DEFAULT, device=dev, buffer=a,
                                                element_type=_element_type(dtype))
        return cls(device_uri, bv.get_buffer(), a.shape, dtype)

    @classmethod
    def from_result(cls, result, dtype: str, device_uri: str) -> "DeviceTensor":
        """Wrap a function result (an iree DeviceArray)."""
        bv = result._buffer_view
        return cls(device_uri, bv.get_buffer(), bv.shape, dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, shape) -> "DeviceTensor":
        shape = tuple(int(x) for x in shape)
        if int(np.prod(shape)) != int(np.prod(self.shape)):
            raise ValueError(f"cannot reshape {list(self.shape)} to {list(shape)}")
        return DeviceTensor(self.device_uri, self._buffer, shape, self.dtype)

    def buffer_view(self, typed_bf16: bool = True):
        import iree.runtime as rt

        return rt.HalBufferView(self._buffer, list(self.shape), _element_type(self.dtype, typed_bf16))

    def to_numpy(self) -> np.ndarray:
        import iree.runtime as rt

        arr = rt.DeviceArray(get_device(self.device_uri), self.buffer_view(typed_bf16=False))
        return np.array(arr.to_host(), copy=True).view(_HOST_DTYPES[self.dtype]).reshape(self.shape)

    def to_torch(self):
        import torch

        t = torch.from_numpy(self.to_numpy())
        return t.view(torch.bfloat16) if self.dtype == "bf16" else t

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device_uri!r})"


class FmhaModule:
    """A compiled FMHA module on a device: ``init`` / ``step`` / ``finalize`` (the plan's entry
    points, see ``graph.py``) and, in GPU modules, ``dense`` / ``causal`` (one call for a whole
    unmasked or causal batch, see ``mlir/dense.mlir.in`` and ``mlir/causal.mlir.in``).

    ``dense`` is ``{"align": A, "causal_blocks": NB}`` when the module has the dense entries;
    ``typed_bf16`` says whether its q/k/v arguments are typed bf16 (MLIR templates) rather than
    int16 (torch graphs)."""

    def __init__(self, vmfb: bytes, device_uri: str, name: str, *, dense: dict | None = None,
                 typed_bf16: bool = False):
        import iree.runtime as rt

        self.device_uri = device_uri
        self.device = get_device(device_uri)
        self._ctx = rt.SystemContext(config=rt.Config(device=self.device))
        self._ctx.add_vm_module(rt.VmModule.copy_buffer(self._ctx.instance, vmfb))
        mod = self._ctx.modules[name]
        self._init, self._step, self._finalize = mod["init"], mod["step"], mod["finalize"]
        self.dense = dense
        if dense:
            self._dense, self._causal = mod["dense"], mod["causal"]
        self.typed_bf16 = typed_bf16
        self._lock = threading.Lock()

    def _put(self, a, dtype: str):
        """A buffer view of an input: uploaded from the host, or a DeviceTensor's own buffer."""
        if isinstance(a, DeviceTensor):
            if a.device_uri != self.device_uri:
                raise ValueError(f"input lives on {a.device_uri!r}, the module on {self.device_uri!r}")
            return a.buffer_view(self.typed_bf16)
        return DeviceTensor.from_host(a, dtype, self.device_uri).buffer_view(self.typed_bf16)

    def _result(self, r, dtype: str, keep: bool):
        t = DeviceTensor.from_result(r, dtype, self.device_uri)
        return t if keep else t.to_numpy()

    def run(self, q, k, v, dtype: str, scale: float, hk: int, plan: Plan, *, keep_on_device: bool = False):
        """Execute ``plan``; q/k/v are ABI numpy arrays or DeviceTensors. Returns (out, lse) as numpy
        arrays, or as DeviceTensors with ``keep_on_device``."""
        with self._lock:
            acc, m, l = self._init(np.zeros((plan.n_tiles, hk), np.int32))
            if plan.calls:
                qd, kd, vd = self._put(q, dtype), self._put(k, dtype), self._put(v, dtype)
                sd = np.array([scale], np.float32)
            for desc in plan.calls:
                acc, m, l = self._step(qd, kd, vd, sd, acc, m, l, desc)
            out, lse = self._finalize(acc, m, l, plan.out_map, plan.lse_map)
            # Results are copied out (to_numpy): CPU drivers may map the device buffer itself,
            # which the allocator reuses in later calls.
            return self._result(out, dtype, keep_on_device), self._result(lse, "f32", keep_on_device)

    def run_dense(self, q, k, v, dtype: str, scale: float, layout: str, causal: bool, *,
                  keep_on_device: bool = False):
        """One call for a whole batch where every row sees every key (``causal=False``) or row i
        sees keys j <= i (``causal=True``, Sq == Sk); lengths multiples of ``dense["align"]``
        (times ``dense["causal_blocks"]`` for causal). q/k/v are 4-D in ``layout``."""
        a = self.dense["align"]

        def tiled(x):
            b, s1, s2, d = x.shape
            shape = (b, s1, s2 // a, a, d) if layout == "bhsd" else (b, s1 // a, a, s2, d)
            return x.reshape(shape)

        with self._lock:
            qd, kd, vd = (self._put(tiled(x), dtype) for x in (q, k, v))
            sd = np.array([scale], np.float32)
            out, lse = (self._causal if causal else self._dense)(qd, kd, vd, sd)
            out, lse = self._result(out, dtype, keep_on_device), self._result(lse, "f32", keep_on_device)
        b, s1, s2, _ = q.shape
        sq, hq = (s2, s1) if layout == "bhsd" else (s1, s2)
        return out.reshape(q.shape[:3] + (out.shape[-1],)), lse.reshape((b, hq, sq))


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
    mod = FmhaModule(path.read_bytes(), uri, manifest["module"], dense=manifest.get("dense"),
                     typed_bf16=manifest["target"]["backend"] != "llvm-cpu")
    return DeployedFmha(manifest, mod)
