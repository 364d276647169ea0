"""Runtime: a compiled FMHA module loaded on an IREE device, and calls of its functions.

Needs only ``iree-base-runtime`` and numpy (no torch, no compiler, no code generator). It knows
how to pass arguments, keep workspaces and order calls, and nothing of what the functions compute:
which function serves a problem and what its tables hold is the paths' business (``paths``).
:class:`FmhaModule` runs what it is given (a table built for other shapes reads out of bounds), so
the public ways in are :func:`fmha_iree.fmha_fwd` and :func:`fmha_iree.load`, which validate first.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from .device import DEVICES, DeviceTensor, exhausted, get_device, host_buffer, memory_errors
from .staging import UploadRing

__all__ = ["Const", "Upload", "Staged", "Host", "Bound"]  # FmhaModule is internal: deployed modules are fmha_iree.load(path)


@dataclasses.dataclass(frozen=True)
class Const:
    """A small array argument uploaded once per value and kept (a scale, a window width)."""

    array: np.ndarray
    dtype: str


@dataclasses.dataclass(frozen=True)
class Upload:
    """An int32 array argument uploaded for this call."""

    array: np.ndarray


@dataclasses.dataclass(frozen=True)
class Staged:
    """An int32 array argument uploaded through the module's upload ring (``staging``): no host
    wait; the ring's slots also bound the calls in flight."""

    array: np.ndarray


@dataclasses.dataclass(frozen=True)
class Host:
    """An int64 array passed as a host buffer (read by the module's own host code)."""

    array: np.ndarray


@dataclasses.dataclass(frozen=True)
class Bound:
    """A buffer view already on the device and the fence it is ready at (a previous call's result)."""

    view: object
    fence: object = None


class FmhaModule:
    """A compiled FMHA module on a device.

    Functions compiled with ``--iree-execution-model=async-external`` (GPU modules) are invoked
    with a wait and a signal fence: a call returns at once, its results are DeviceTensors that
    are ready at its signal fence, and back-to-back calls on ready inputs queue on the device with
    no host round trip in between (docs/BENCHMARKS.md, "Asynchronous calls"). A call given a
    result that is not ready yet waits for it on the host.

    Functions that take a workspace (``iree.abi.transients``: the one-call GPU entries) get one
    of ``WORKSPACE_SLOTS`` device buffers, each grown to the largest size asked of it (IREE's
    ``<fn>_transients_size`` query on the call's arguments). A slot is reused only after the
    call that last used it has finished (the host waits for it if not), so at most that many
    calls are in flight and none shares its intermediates with another.

    ``typed_bf16``: whether bf16 arguments are typed bf16 (MLIR templates) rather than int16
    (torch graphs)."""

    WORKSPACE_SLOTS = 2

    def __init__(self, vmfb: bytes, device_uri: str, name: str, *, typed_bf16: bool = False):
        import iree.runtime as rt

        self.name = name
        self.device_uri = device_uri
        self._ring = UploadRing(device_uri)
        self.device = get_device(device_uri)
        self._keeper = DEVICES.keeper(device_uri)
        self._ctx = rt.SystemContext(config=rt.Config(device=self.device))
        vm = rt.VmModule.copy_buffer(self._ctx.instance, vmfb)
        self._ctx.add_vm_module(vm)
        self._fns = {n: vm.lookup_function(n) for n in vm.function_names}
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

    def _constant(self, a: np.ndarray, dtype: str):
        """A small argument as a device buffer, uploaded once per value (a host array would be
        copied from pageable memory on every call: docs/BENCHMARKS.md, "Asynchronous calls")."""
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

    @property
    def functions(self) -> frozenset:
        """The module's exported functions."""
        return frozenset(self._fns)

    @property
    def lock(self):
        """Held around a sequence of :meth:`invoke` calls that must not interleave with others."""
        return self._lock

    def arg(self, a, dtype: str | None = None):
        """(buffer view, fence or None) of one argument: a host array or DeviceTensor with its
        ``dtype``, or a :class:`Const`, :class:`Upload`, :class:`Staged` (its fence handed back
        by :meth:`invoke`), :class:`Host` or :class:`Bound`."""
        if isinstance(a, Bound):
            return a.view, a.fence
        if isinstance(a, Const):
            return self._constant(np.ascontiguousarray(a.array), a.dtype), None
        if isinstance(a, Upload):
            return DeviceTensor.from_host(np.ascontiguousarray(a.array, np.int32), "i32",
                                          self.device_uri).buffer_view(), None
        if isinstance(a, Host):
            return host_buffer(a.array), None
        return self._put(a, dtype)

    def invoke(self, fn: str, args: list, n_results: int, scalars: tuple = ()) -> tuple[list, object]:
        """One call of ``fn`` (hold :attr:`lock`): ``args`` as :meth:`arg` takes them (a pair
        ``(array, dtype)`` for a tensor), then ``scalars`` (floats as f32, ints as i64). Returns
        (the result buffer views, the fence they are ready at)."""
        views, ups = [], None
        for a in args:  # the per-call path of every replayed call: kept to plain type tests
            if type(a) is tuple:
                views.append(self._put(a[0], a[1]))
            elif type(a) is Staged:
                up = self._ring.put(np.ascontiguousarray(a.array, np.int32).ravel())
                ups = [up] if ups is None else ups + [up]
                views.append((up[0], None))
            else:
                views.append(self.arg(a))
        if ups is None:
            return self._call(fn, views, n_results, scalars=scalars)
        waits = tuple(f for _, f, _ in ups if f is not None)
        rets, fence = self._call(fn, views, n_results, scalars=scalars, queue_waits=waits)
        for _, _, read_by in ups:
            read_by(fence)
        return rets, fence

    def result(self, view, fence, dtype: str, keep: bool):
        """A result as numpy (copied out: CPU drivers may map the device buffer itself, which the
        allocator reuses in later calls) or, with ``keep``, a DeviceTensor ready at ``fence``."""
        t = DeviceTensor.from_result(view, dtype, self.device_uri, fence)
        return t if keep else t.to_numpy()

    def call(self, fn: str, args: list, *, scalars: tuple = (), results=(), keep_on_device: bool = False) -> list:
        """One call of ``fn`` (:meth:`invoke`'s ``args`` and ``scalars``); returns its first
        ``len(results)`` results with those dtypes (the rest dropped), numpy or DeviceTensors with
        ``keep_on_device``."""
        with self._lock:
            rets, fence = self.invoke(fn, args, len(results), scalars)
            return [self.result(bv, fence, dtype, keep_on_device) for bv, dtype in zip(rets, results)]
