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


_HOST_DTYPES = {"f16": np.float16, "bf16": np.int16, "f32": np.float32, "i32": np.int32}


def _element_type(dtype: str, typed_bf16: bool = True):
    import iree.runtime as rt

    if dtype == "bf16":
        return rt.HalElementType.BFLOAT_16 if typed_bf16 else rt.HalElementType.SINT_16
    return {"f16": rt.HalElementType.FLOAT_16, "f32": rt.HalElementType.FLOAT_32,
            "i32": rt.HalElementType.SINT_32}[dtype]


class DeviceTensor:
    """An array that lives on an IREE device (see :func:`fmha_iree.to_device`).

    Inputs given as DeviceTensors are read where they are, and results come back as DeviceTensors
    (nothing crosses the host bus); ``to_numpy`` / ``to_torch`` copy to the host. bf16 data is
    typed bf16 on the device; numpy sees its bits as int16.
    """

    def __init__(self, device_uri: str, buffer, shape, dtype: str, ready=None):
        self.device_uri = device_uri
        self._buffer = buffer  # HalBuffer, shared by reshaped views
        self.shape = tuple(int(x) for x in shape)
        self.dtype = dtype
        # HalFence reached once the contents are written (results of asynchronous calls; None:
        # ready now). Reading it (to_numpy, or as the input of another call) waits for it first.
        self.ready = ready

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
    def from_result(cls, bv, dtype: str, device_uri: str, ready=None) -> "DeviceTensor":
        """Wrap a function result (a HalBufferView), ready at the fence ``ready``."""
        return cls(device_uri, bv.get_buffer(), bv.shape, dtype, ready)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, shape) -> "DeviceTensor":
        shape = tuple(int(x) for x in shape)
        if int(np.prod(shape)) != int(np.prod(self.shape)):
            raise ValueError(f"cannot reshape {list(self.shape)} to {list(shape)}")
        return DeviceTensor(self.device_uri, self._buffer, shape, self.dtype, self.ready)

    def buffer_view(self, typed_bf16: bool = True):
        import iree.runtime as rt

        return rt.HalBufferView(self._buffer, list(self.shape), _element_type(self.dtype, typed_bf16))

    def wait(self) -> "DeviceTensor":
        """Block until the contents are written (results of asynchronous calls); returns self."""
        if self.ready is not None:
            self.ready.wait()
        return self

    def to_numpy(self) -> np.ndarray:
        import iree.runtime as rt

        self.wait()
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
    unmasked or causal batch, see ``mlir/dense.mlir.in`` and ``mlir/causal.mlir.in``) and, per
    compiled-in length S, ``causal_s<S>`` (``mlir_templates.render_causal_tree``) and
    ``dense_o_s<S>`` (``mlir/dense_out.mlir.in``).

    ``dense`` is the manifest's ``dense`` record (``align``, ``causal_blocks``, ``seqlens``) when
    the module has those entries; ``typed_bf16`` says whether its q/k/v
    arguments are typed bf16 (MLIR templates) rather than int16 (torch graphs).

    Functions compiled with ``--iree-execution-model=async-external`` (GPU modules) are invoked
    with a wait and a signal fence: a call returns at once, its results are DeviceTensors that
    are ready at its signal fence, and back-to-back calls on ready inputs queue on the device with
    no host round trip in between (on the H200 that removed ~1 ms of idle GPU per call,
    docs/BENCHMARKS.md). A call given a result that is not ready yet waits for it on the host.

    Entry points that take a workspace (``iree.abi.transients``: the one-call GPU entries) get one
    of ``WORKSPACE_SLOTS`` device buffers, each grown to the largest size asked of it (IREE's
    ``<fn>_transients_size`` query on the call's arguments). A slot is reused only after the
    call that last used it has finished (the host waits for it if not), so at most that many
    calls are in flight and none shares its intermediates with another."""

    WORKSPACE_SLOTS = 2

    def __init__(self, vmfb: bytes, device_uri: str, name: str, *, dense: dict | None = None,
                 typed_bf16: bool = False):
        import iree.runtime as rt

        self.device_uri = device_uri
        self.device = get_device(device_uri)
        self._ctx = rt.SystemContext(config=rt.Config(device=self.device))
        vm = rt.VmModule.copy_buffer(self._ctx.instance, vmfb)
        self._ctx.add_vm_module(vm)
        self._fns = {n: vm.lookup_function(n) for n in vm.function_names}
        missing = {"init", "finalize"} - set(self._fns)
        if missing:
            raise ValueError(f"module {name!r} lacks the entry points {sorted(missing)}")
        self.dense = dense
        self.typed_bf16 = typed_bf16
        self._scales: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._ws_sizes: dict[tuple, int] = {}
        self._ws_slots = [[None, 0, None] for _ in range(self.WORKSPACE_SLOTS)]  # buffer, bytes, fence
        self._ws_next = 0
        self._ws_empty = None

    @property
    def workspace_bytes(self) -> int:
        """Device memory held for workspaces (see the class docstring)."""
        return sum(n for _, n, _ in self._ws_slots)

    def release_workspace(self):
        """Drop the workspace buffers (after waiting for the calls that use them)."""
        with self._lock:
            for slot in self._ws_slots:
                if slot[2] is not None:
                    slot[2].wait()
                slot[:] = [None, 0, None]

    def _device_buffer(self, nbytes: int):
        import iree.runtime as rt

        return self.device.allocator.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                     allowed_usage=rt.BufferUsage.DEFAULT,
                                                     allocation_size=max(int(nbytes), 256))

    def _workspace(self, fn: str, bvs: list, coarse: bool):
        """(buffer, slot or None) for a call of ``fn`` on the buffer views ``bvs``."""
        import iree.runtime as rt

        if self._ws_empty is None:
            self._ws_empty = self._device_buffer(0)
        key = (fn,) + tuple(tuple(bv.shape) for bv in bvs)
        need = self._ws_sizes.get(key)
        if need is None:
            lst = rt.VmVariantList(len(bvs) + 3)
            for bv in bvs:
                lst.push_ref(bv)
            lst.push_ref(self._ws_empty)
            if coarse:
                lst.push_ref(rt.HalFence(1))
                lst.push_ref(rt.HalFence(1))
            rets = rt.VmVariantList(1)
            self._ctx.vm_context.invoke(self._fns[self._fns[fn].reflection["iree.abi.transients.size"].lstrip("@")],
                                        lst, rets)
            need = self._ws_sizes[key] = int(rets.get_variant(0))
        if need == 0:
            return self._ws_empty, None
        slot = self._ws_slots[self._ws_next]
        self._ws_next = (self._ws_next + 1) % len(self._ws_slots)
        if slot[2] is not None:
            slot[2].wait()
            slot[2] = None
        if slot[1] < need:
            slot[0], slot[1] = None, 0  # the smaller buffer goes before the larger one comes
            slot[0], slot[1] = self._device_buffer(need), need
        return slot[0], slot

    def _put(self, a, dtype: str):
        """(buffer view, fence or None) of an input: uploaded from the host, or a DeviceTensor's
        own buffer."""
        if isinstance(a, DeviceTensor):
            if a.device_uri != self.device_uri:
                raise ValueError(f"input lives on {a.device_uri!r}, the module on {self.device_uri!r}")
            return a.buffer_view(self.typed_bf16), a.ready
        return DeviceTensor.from_host(a, dtype, self.device_uri).buffer_view(self.typed_bf16), None

    def _scale(self, scale: float):
        """The scale as a device buffer, uploaded once per value (a host array would be copied
        from pageable memory on every call: ~0.45 ms on the H200)."""
        return self._constant(np.array([scale], np.float32), "f32")

    def _constant(self, a: np.ndarray, dtype: str):
        """A small argument as a device buffer, uploaded once per value (see ``_scale``)."""
        key = (dtype, a.tobytes())
        bv = self._scales.get(key)
        if bv is None:
            bv = DeviceTensor.from_host(a, dtype, self.device_uri).buffer_view()
            if len(self._scales) < 64:
                self._scales[key] = bv
        return bv

    def _call(self, fn: str, args: list, n_results: int, scalars: tuple = ()) -> tuple[list, object]:
        """Invoke ``fn`` on (buffer view, fence) args followed by ``scalars`` (floats pushed as
        f32, ints as i64 primitives); returns (result buffer views, fence)."""
        import iree.runtime as rt

        # Inputs must exist before a call records its dispatches: a result of an unfinished
        # asynchronous call is a transient buffer not yet committed (IREE's local driver refuses
        # it), so the host waits for those first. Calls on ready inputs (uploaded tensors, the
        # usual case) return at once and queue on the device behind each other. torch-exported
        # functions (`init`, `finalize`) are called in their synchronous form.
        for _, w in args:
            if w is not None:
                w.wait()
        f = self._fns[fn]
        coarse = f.reflection.get("iree.abi.model") == "coarse-fences"
        lst = rt.VmVariantList(len(args) + len(scalars) + 3)
        for bv, _ in args:
            lst.push_ref(bv)
        for x in scalars:
            if isinstance(x, float):
                lst.push_float(x)
            else:
                lst.push_int(int(x))
        slot = None
        if "iree.abi.transients.size" in f.reflection:
            ws, slot = self._workspace(fn, [bv for bv, _ in args], coarse)
            lst.push_ref(ws)
        fence = None
        if coarse:
            # a semaphore per call: independent calls may finish out of order (local-task runs
            # them concurrently), and a shared timeline cannot be signaled backwards
            fence = rt.HalFence.create_at(self.device.create_semaphore(0), 1)
            lst.push_ref(rt.HalFence(1))  # nothing to wait for: the inputs are ready
            lst.push_ref(fence)
        rets = rt.VmVariantList(n_results)
        self._ctx.vm_context.invoke(f, lst, rets)
        if slot is not None:
            slot[2] = fence
        return [rets.get_as_object(i, rt.HalBufferView) for i in range(n_results)], fence

    def _result(self, bv, fence, dtype: str, keep: bool):
        # Results are copied out (to_numpy): CPU drivers may map the device buffer itself, which
        # the allocator reuses in later calls.
        t = DeviceTensor.from_result(bv, dtype, self.device_uri, fence)
        return t if keep else t.to_numpy()

    def run(self, q, k, v, dtype: str, scale: float, hk: int, plan: Plan, *, keep_on_device: bool = False):
        """Execute ``plan``; q/k/v are ABI numpy arrays or DeviceTensors. Returns (out, lse) as numpy
        arrays, or as DeviceTensors with ``keep_on_device``."""
        i32 = lambda a: (DeviceTensor.from_host(a, "i32", self.device_uri).buffer_view(), None)  # noqa: E731
        with self._lock:
            (acc, m, l), fence = self._call("init", [i32(np.zeros((plan.n_tiles, hk), np.int32))], 3)
            if plan.calls:
                qkv = [self._put(x, dtype) for x in (q, k, v)]
                sd = (self._scale(float(scale)), None)
            for desc in plan.calls:
                (acc, m, l), fence = self._call("step", qkv + [sd, (acc, fence), (m, fence), (l, fence), i32(desc)], 3)
            (out, lse), fence = self._call("finalize", [(acc, fence), (m, fence), (l, fence), i32(plan.out_map),
                                                        i32(plan.lse_map)], 2)
            return self._result(out, fence, dtype, keep_on_device), self._result(lse, fence, "f32", keep_on_device)

    def dense_entry(self, sq: int, sk: int, causal: bool, with_lse: bool, batch: int | None = None,
                    kv_heads: int | None = None, window: int | None = None) -> str | None:
        """The one-call entry point of this module for the problem (see :func:`dense_entry`)."""
        return dense_entry(self.dense, sq, sk, causal, with_lse, batch, kv_heads, window)

    def run_dense(self, q, k, v, dtype: str, scale: float, layout: str, causal: bool, *,
                  keep_on_device: bool = False, with_lse: bool = True, window: int | None = None):
        """One call for a whole batch where every row sees every key (``causal=False``), row i
        sees keys j <= i (``causal=True``, Sq == Sk) or, with ``window`` W, keys i - W <= j <= i;
        the caller checked ``dense_entry``. q/k/v are 4-D in ``layout``. Returns (out, lse); lse
        is None when ``with_lse`` is False and the module has an entry point without it."""
        a = self.dense["align"]
        b, s1, s2, _ = q.shape
        sq, hq = (s2, s1) if layout == "bhsd" else (s1, s2)
        sk, hk = (k.shape[2], k.shape[1]) if layout == "bhsd" else (k.shape[1], k.shape[2])
        fn = self.dense_entry(sq, sk, causal, with_lse, b, hk, window)

        def tiled(x):
            if not self.dense.get("tiled", True):
                return x
            b, s1, s2, d = x.shape
            shape = (b, s1, s2 // a, a, d) if layout == "bhsd" else (b, s1 // a, a, s2, d)
            return x.reshape(shape)

        with self._lock:
            args = [self._put(tiled(x), dtype) for x in (q, k, v)] + [(self._scale(float(scale)), None)]
            if window is not None:
                args.append((self._constant(np.array([window], np.int32), "i32"), None))
            if "_o_s" in fn:
                (out,), fence = self._call(fn, args, 1)
                out = self._result(out, fence, dtype, keep_on_device)
                return out.reshape(q.shape[:3] + (out.shape[-1],)), None
            (out, lse), fence = self._call(fn, args, 2)
            out, lse = self._result(out, fence, dtype, keep_on_device), self._result(lse, fence, "f32", keep_on_device)
        return out.reshape(q.shape[:3] + (out.shape[-1],)), lse.reshape((b, hq, sq))


    @property
    def has_fwd(self) -> bool:
        """Whether the module has ``fwd`` (any lengths and mask in one call, ``kernels.general``)."""
        return "fwd" in self._fns

    def run_fwd(self, q, k, v, dtype: str, scale: float, coords: tuple[int, int], *, keep_on_device: bool = False):
        """One ``fwd`` call: q/k/v in the module's layout (4-D), ``coords`` CK's (y, x) for this
        problem, already clipped to the lengths (``spec.clip_coords``). Returns (out, lse [B, Hq, Sq])."""
        with self._lock:
            args = [self._put(x, dtype) for x in (q, k, v)]
            (out, lse), fence = self._call("fwd", args, 2, scalars=(float(scale), int(coords[0]), int(coords[1])))
            return self._result(out, fence, dtype, keep_on_device), self._result(lse, fence, "f32", keep_on_device)


def dense_entry(dense: dict | None, sq: int, sk: int, causal: bool, with_lse: bool, batch: int | None = None,
                kv_heads: int | None = None, window: int | None = None) -> str | None:
    """The one-call entry point a module with the manifest record ``dense`` has for a full-length
    (no padding) batch, or None (the plan then runs it). ``batch`` / ``kv_heads``: the problem's,
    checked against what compiled-in entries were fixed to (None: not checked).

    Lengths must be multiples of ``align``. Unmasked: ``dense_o_s<S>`` (IREE's fused attention op,
    no LSE) when LSE is not wanted and Sq == Sk == S is a compiled-in length, else ``dense``.
    Causal (Sq == Sk) at a compiled-in length: ``causal_o_s<S>`` (masked fused op) without LSE
    where the module has it, else ``causal_s<S>``; other lengths: ``causal`` for multiples of
    ``align * causal_blocks``. A sliding window (``window`` W: row i sees keys i - W <= j <= i,
    Sq == Sk): ``window_s<S>`` at a compiled-in length whose block holds W (``dense["window"]``).
    CPU records (``dynamic`` False) have only the compiled-in entries (``dense_s``, ``causal_s``,
    ``dense_o_s``, ``causal_o_s``)."""
    if not dense or sq < 1 or sk < 1:
        return None
    a = dense["align"]
    if sq % a or sk % a:
        return None
    pinned_ok = all(not dense.get(key) or have is None or have == dense[key]
                    for key, have in (("batch", batch), ("kv_heads", kv_heads)))
    fixed = sq == sk and sq in dense.get("seqlens", ()) and pinned_ok
    if window is not None:
        c = dict(dense.get("window", ())).get(sq) if fixed else None  # None: no window_s<S> in the module
        return f"window_s{sq}" if c is not None and 0 <= window <= c else None
    if not dense.get("dynamic", True):
        return f"{'causal' if causal else 'dense'}{'' if with_lse else '_o'}_s{sq}" if fixed else None
    if not causal:
        return f"dense_o_s{sq}" if fixed and not with_lse else "dense"
    if sq != sk:
        return None
    if fixed:
        return f"causal_o_s{sq}" if not with_lse and sq in dense.get("causal_o", ()) else f"causal_s{sq}"
    nb = dense["causal_blocks"]
    return "causal" if nb and sq % (a * nb) == 0 else None


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
        """Batch mode, as :func:`fmha_iree.fmha_fwd`."""
        from .api import run_batch
        from .spec import check_batch

        pr = self.manifest["problem"]
        p = check_batch(q, k, v, mask=pr.get("mask") if mask is None else mask, scale=scale, layout=pr["layout"],
                        cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k)
        self._check(p, return_lse)
        return run_batch(p, return_lse, self.tiles, lambda: self.module, self.manifest["target"]["family"])

    def varlen(self, q, k, v, seqstart_q, seqstart_k, *, seqlen_k=None, seqstart_padded_q=None,
               seqstart_padded_k=None, mask=None, scale=None, return_lse=False):
        """Group mode, as :func:`fmha_iree.fmha_fwd_varlen` (``q`` ``[Tq, Hq, Dq]`` ...): needs a
        module compiled with ``--layout bshd`` (packed tokens are bshd rows of one sequence)."""
        from .api import run_varlen
        from .spec import check_varlen

        pr = self.manifest["problem"]
        if pr["layout"] != "bshd":
            raise ValueError(f"group mode needs a module compiled with --layout bshd; this one has layout {pr['layout']!r}")
        p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                                 seqstart_padded_k=seqstart_padded_k, mask=pr.get("mask") if mask is None else mask,
                                 scale=scale)
        self._check(p, return_lse)
        return run_varlen(p, starts, return_lse, self.tiles, lambda: self.module, self.manifest["target"]["family"])

    def _check(self, p, return_lse):
        """Refuse a problem the module was not compiled for, before anything runs."""
        pr = self.manifest["problem"]
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
