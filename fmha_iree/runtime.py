"""Runtime: a compiled FMHA module loaded on an IREE device, and the calls of its entry points.

Needs only ``iree-base-runtime`` and numpy (no torch, no compiler). :class:`FmhaModule` is the
library's internal handle: it runs what it is given (a plan built for other shapes reads out of
bounds), so the public ways in are :func:`fmha_iree.fmha_fwd` and :func:`fmha_iree.load`, which
validate first.
"""

from __future__ import annotations

import threading

import numpy as np

from .device import DEVICES, DeviceTensor, exhausted, get_device, host_buffer, memory_errors
from .entries import dense_entry
from .plan import Block, Plan
from .staging import UploadRing

__all__: list[str] = []  # FmhaModule is internal: deployed modules are fmha_iree.load(path)


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
                 typed_bf16: bool = False, layout: str | None = None):
        import iree.runtime as rt

        self.device_uri = device_uri
        self.layout = layout  # of q / k / v in its entry points (None: not known)
        self._ring = UploadRing(device_uri)
        self.device = get_device(device_uri)
        self._keeper = DEVICES.keeper(device_uri)
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
        self._abis: dict[str, tuple[bool, bool]] = {}
        self._lock = threading.Lock()
        self._ws_sizes: dict[tuple, int] = {}
        self._ws_slots = [[None, 0, None] for _ in range(self.WORKSPACE_SLOTS)]  # buffer, bytes, fence
        self._ws_next = 0
        self._ws_empty = None

    @property
    def workspace_bytes(self) -> int:
        """Device memory held for workspaces (see the class docstring)."""
        return sum(n for _, n, _ in self._ws_slots)

    @property
    def workspace_sizes(self) -> dict:
        """Bytes each entry point asked for its intermediates, by (function, argument shapes...):
        IREE's ``<fn>_transients_size`` answers, read once per shape."""
        return dict(self._ws_sizes)

    def release_workspace(self):
        """Drop the workspace buffers (after waiting for the calls that use them)."""
        with self._lock:
            for slot in self._ws_slots:
                if slot[2] is not None:
                    slot[2].wait()
                slot[:] = [None, 0, None]

    def _device_buffer(self, nbytes: int):
        import iree.runtime as rt

        with memory_errors(self.device_uri, f"a {int(nbytes)}-byte workspace"):
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
        """(buffer view, fence or None) of an input: a host array (read in place by CPU drivers,
        ``DeviceTensor.from_host_view``, else uploaded), or a DeviceTensor's own buffer."""
        if isinstance(a, DeviceTensor):
            if a.device_uri != self.device_uri:
                raise ValueError(f"input lives on {a.device_uri!r}, the module on {self.device_uri!r}")
            return a.buffer_view(self.typed_bf16), a.ready
        return DeviceTensor.from_host_view(a, dtype, self.device_uri).buffer_view(self.typed_bf16), None

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

    def _call(self, fn: str, args: list, n_results: int, scalars: tuple = (), queue_waits: tuple = ()) -> tuple[list, object]:
        """Invoke ``fn`` on (buffer view, fence) args followed by ``scalars`` (floats pushed as
        f32, ints as i64 primitives); ``queue_waits``: fences the call waits on on the device
        (staged uploads). Returns (result buffer views, fence)."""
        import iree.runtime as rt

        # Inputs must exist before a call records its dispatches: a result of an unfinished
        # asynchronous call is a transient buffer not yet committed (IREE's local driver refuses
        # it), so the host waits for those first. Calls on ready inputs (uploaded tensors, the
        # usual case) return at once and queue on the device behind each other. torch-exported
        # functions (`init`, `finalize`) are called in their synchronous form.
        waits = [w for _, w in args if w is not None]
        if waits:
            with memory_errors(self.device_uri, f"the calls that write {fn}'s inputs"):
                for w in waits:
                    w.wait()
        f = self._fns[fn]
        coarse, has_transients = self._abi(fn)
        if queue_waits and not coarse:
            for w in queue_waits:
                w.wait()
        lst = rt.VmVariantList(len(args) + len(scalars) + 3)
        for bv, _ in args:
            lst.push_ref(bv)
        for x in scalars:
            if isinstance(x, float):
                lst.push_float(x)
            else:
                lst.push_int(int(x))
        slot = None
        if has_transients:
            ws, slot = self._workspace(fn, [bv for bv, _ in args], coarse)
            lst.push_ref(ws)
        fence = None
        if coarse:
            # a semaphore per call: independent calls may finish out of order (local-task runs
            # them concurrently), and a shared timeline cannot be signaled backwards
            fence = rt.HalFence.create_at(self.device.create_semaphore(0), 1)
            lst.push_ref(rt.HalFence.join(list(queue_waits)) if queue_waits else rt.HalFence(1))
            lst.push_ref(fence)
        rets = rt.VmVariantList(n_results)
        try:
            self._ctx.vm_context.invoke(f, lst, rets)
        except RuntimeError as e:
            err = exhausted(e, self.device_uri, f"{fn}'s results and intermediates")
            if err is None:
                raise
            raise err from e
        if self._keeper is not None:
            self._keeper.after_call()  # bounds the released buffers the device keeps
        if slot is not None:
            slot[2] = fence
        return [rets.get_as_object(i, rt.HalBufferView) for i in range(n_results)], fence

    def _abi(self, fn: str) -> tuple[bool, bool]:
        """(coarse fences, takes a workspace) of ``fn``, read from its reflection once."""
        abi = self._abis.get(fn)
        if abi is None:
            r = self._fns[fn].reflection
            abi = self._abis[fn] = (r.get("iree.abi.model") == "coarse-fences", "iree.abi.transients.size" in r)
        return abi

    def _result(self, bv, fence, dtype: str, keep: bool):
        # Results are copied out (to_numpy): CPU drivers may map the device buffer itself, which
        # the allocator reuses in later calls.
        t = DeviceTensor.from_result(bv, dtype, self.device_uri, fence)
        return t if keep else t.to_numpy()

    def run(self, q, k, v, dtype: str, scale: float, hk: int, plan: Plan, *, keep_on_device: bool = False):
        """Execute ``plan``; q/k/v are ABI numpy arrays or DeviceTensors. Returns (out, lse) as numpy
        arrays, or as DeviceTensors with ``keep_on_device``. A plan of several state blocks runs
        them one after another, each from a fresh state, and joins their states for ``finalize``
        (on the host: such plans are the CPU's, ``plan.state_tiles``)."""
        with self._lock:
            qkv = [self._put(x, dtype) for x in (q, k, v)] if plan.n_calls else []
            sd = (self._scale(float(scale)), None)
            states = [self._run_block(qkv, sd, hk, blk) for blk in plan.blocks]
            if len(states) == 1:
                (acc, m, l), fence = states[0]
                state = [(acc, fence), (m, fence), (l, fence)]
            else:
                parts = [[DeviceTensor.from_result(x, "f32", self.device_uri, fence).to_numpy() for x in st]
                         for st, fence in states]
                state = [(DeviceTensor.from_host(np.concatenate(xs), "f32", self.device_uri).buffer_view(), None)
                         for xs in zip(*parts)]
            (out, lse), fence = self._call("finalize", state + [self._i32(plan.out_map), self._i32(plan.lse_map)], 2)
            return self._result(out, fence, dtype, keep_on_device), self._result(lse, fence, "f32", keep_on_device)

    def _i32(self, a: np.ndarray):
        """An int32 host array as a (buffer view, no fence) call argument."""
        return DeviceTensor.from_host(a, "i32", self.device_uri).buffer_view(), None

    def _run_block(self, qkv: list, sd, hk: int, blk: Block):
        """One state block of a plan: ``init`` and its ``step`` calls. Returns ((acc, m, l), fence)."""
        (acc, m, l), fence = self._call("init", [self._i32(np.zeros((blk.n_tiles, hk), np.int32))], 3)
        open_fn = "step_open" if self.has("step_open") else "step"  # CPU modules before 2026-12-04 lack it
        for desc, unmasked in zip(blk.calls, blk.unmasked):
            fn = open_fn if unmasked else "step"
            (acc, m, l), fence = self._call(fn, qkv + [sd, (acc, fence), (m, fence), (l, fence), self._i32(desc)], 3)
        return (acc, m, l), fence

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
    def function_names(self) -> list[str]:
        """The module's exported functions."""
        return list(self._fns)

    def has(self, fn: str) -> bool:
        """Whether the module exports the function ``fn`` (e.g. ``rows_packed``, ``rows_packed_pages``:
        bshd CPU modules built since 2026-12-04 have both, ``mlir_templates.rows_packed``)."""
        return fn in self._fns

    def lacks(self, names) -> list[str]:
        """Those of the function ``names`` the module does not export, sorted."""
        return sorted({n for n in names if n not in self._fns})

    @property
    def has_fwd(self) -> bool:
        """Whether the module has ``fwd`` (any lengths and mask in one call, ``kernels.general``)."""
        return "fwd" in self._fns

    @property
    def has_rows(self) -> bool:
        """Whether the module has ``rows`` / ``rows_kpad`` (CPU modules: any lengths and mask, whole
        key rows)."""
        return "rows" in self._fns and "rows_kpad" in self._fns

    def run_rows(self, q, k, v, dtype: str, scale: float, desc: np.ndarray, *, padded_keys: bool = False,
                 keep_on_device: bool = False):
        """One ``rows`` call (``rows_kpad`` with ``padded_keys``: some batch's klen < Sk; ``rows.Rows``):
        ``desc`` int32 ``[B, 4]``, each batch's (qlen, klen, y, x). Returns (out, lse [B, Hq, Sq])."""
        with self._lock:
            args = [self._put(x, dtype) for x in (q, k, v)]
            args += [(self._scale(float(scale)), None), (self._constant(np.ascontiguousarray(desc, np.int32), "i32"), None)]
            (out, lse), fence = self._call("rows_kpad" if padded_keys else "rows", args, 2)
            return self._result(out, fence, dtype, keep_on_device), self._result(lse, fence, "f32", keep_on_device)

    def run_rows_packed(self, q, k, v, dtype: str, scale: float, desc: np.ndarray, mq: int, mk: int,
                        table: np.ndarray | None = None):
        """One ``rows_packed`` call on packed ``q`` ``[1, Tq, Hq, Dq]`` and ``k`` / ``v``: ``desc``
        int32 ``[n, 6]`` (q_start, qlen, k_start, klen, y, x) per sequence, ``mq`` / ``mk`` at
        least its longest qlen / klen; with ``table`` (the sequences' block-table rows), ``k`` /
        ``v`` are paged caches ``[pages, P, Hk, D]`` read through it (``rows_packed_pages``).
        Returns numpy (out ``[n, mq, Hq, Dv]``, lse ``[n, Hq, mq]``)."""
        with self._lock:
            args = [self._put(x, dtype) for x in (q, k, v)]
            args += [(self._scale(float(scale)), None), self._i32(np.ascontiguousarray(desc, np.int32))]
            if table is not None:
                args.append(self._i32(np.ascontiguousarray(table, np.int32)))
            fn = "rows_packed" if table is None else "rows_packed_pages"
            (out, lse), fence = self._call(fn, args, 2, scalars=(int(mq), int(mk)))
            return self._result(out, fence, dtype, False), self._result(lse, fence, "f32", False)

    def run_tables(self, fn: str, q, k, v, dtype: str, scale: float, tables: tuple = (), host: np.ndarray | None = None):
        """One call of a packed-sequence entry point (``units_varlen``, ``waves_varlen``) on ``q`` /
        ``k`` / ``v`` (group mode's packed ``[1, T, H, D]``, or a batch for ``waves_varlen``), then
        the int32 ``tables`` (device inputs), the int64 ``host`` table as a host buffer the module
        reads in its own host code, and the scale. Returns numpy (out shaped as q with Dv, lse
        ``[B, Hq, S]``)."""
        with self._lock:
            args = [self._put(x, dtype) for x in (q, k, v)] + [self._i32(np.ascontiguousarray(t, np.int32)) for t in tables]
            args += [(host_buffer(host), None)] if host is not None else []
            (out, lse), fence = self._call(fn, args, 2, scalars=(float(scale),))
            return self._result(out, fence, dtype, False), self._result(lse, fence, "f32", False)

    def call(self, fn: str, tensors, *, staged=(), scalars: tuple = (), results=(), keep_on_device: bool = False) -> list:
        """One call of the exported ``fn``: ``tensors`` as (array or DeviceTensor, dtype) pairs,
        then the int32 arrays ``staged`` (uploaded through the module's ``staging.UploadRing``:
        no host wait, each at least its size), then ``scalars`` (floats as f32, ints as i64);
        returns its first ``len(results)`` results with those dtypes (the rest dropped), numpy or
        DeviceTensors with ``keep_on_device``."""
        with self._lock:
            args = [self._put(x, dtype) for x, dtype in tensors]
            ups = [self._ring.put(np.ascontiguousarray(a, np.int32).ravel()) for a in staged]
            args += [(view, None) for view, _, _ in ups]
            waits = tuple(f for _, f, _ in ups if f is not None)
            rets, fence = self._call(fn, args, len(results), scalars=scalars, queue_waits=waits)
            for _, _, read_by in ups:
                read_by(fence)
            return [self._result(bv, fence, dtype, keep_on_device) for bv, dtype in zip(rets, results)]

    def run_fwd(self, q, k, v, dtype: str, scale: float, coords: tuple[int, int], *, keep_on_device: bool = False,
                fn: str = "fwd"):
        """One call of ``fn``, ``fwd`` or the CPU's ``units`` (any lengths and mask, one call): q/k/v
        in the module's layout (4-D), ``coords`` CK's (y, x) for this problem, already clipped to
        the lengths (``Mask.clipped_coords``). Returns (out, lse [B, Hq, Sq])."""
        with self._lock:
            args = [self._put(x, dtype) for x in (q, k, v)]
            (out, lse), fence = self._call(fn, args, 2, scalars=(float(scale), int(coords[0]), int(coords[1])))
            return self._result(out, fence, dtype, keep_on_device), self._result(lse, fence, "f32", keep_on_device)
