"""What every path shares: the problem as the paths see it, a path's answer (a call with
everything but the tensors fixed, or the reasons it refuses), and empty results.

A path is an object with a ``name`` and ``plan(problem, caps)``, which returns a :class:`Call`
(metadata work done once per batch composition, as flashinfer's ``plan()``) or :class:`Refused`
(its ``not_supported_reasons``, as xformers' backends say them). ``Call.run`` takes the tensors
(every call; replayed for DeviceTensors, ``prepared``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.device import DeviceTensor
from ..problem.paged import PagedCache
from ..problem.spec import BatchProblem

__all__ = ["Problem", "Refused", "Call", "EmptyCall", "empty_result", "shaped", "ABI_DTYPES"]

ABI_DTYPES = {"f16": np.float16, "bf16": np.int16, "f32": np.float32}
MODES = ("batch", "group", "paged")


@dataclasses.dataclass(frozen=True)
class Problem:
    """A checked call as the paths see it. ``mode``: ``batch`` (``p`` as the caller gave it),
    ``group`` (``p`` over packed ``[1, T, H, D]`` tensors, ``starts`` = ``spec.check_varlen``'s
    (q_start, q_len, k_start, k_len, lse_start, total_q)) or ``paged`` (as group, keys in
    ``cache``'s pages, ``starts``' key lengths the cache's)."""

    mode: str
    p: BatchProblem
    with_lse: bool
    starts: tuple | None = None
    cache: PagedCache | None = None

    @property
    def padded(self) -> bool:
        """A batch with cu_seqlen padding: some entry uses fewer rows or keys than the tensors hold."""
        p = self.p
        return bool((p.q_lens != p.sq).any() or (p.k_lens != p.sk).any())

    @property
    def on_device(self) -> bool:
        return self.p.q.on_device

    @property
    def group(self) -> int:
        return self.p.hq // self.p.hk

    @property
    def q_len(self) -> np.ndarray:
        """Each sequence's (batch entry's) query rows."""
        return np.asarray(self.p.q_lens if self.mode == "batch" else self.starts[1], np.int64)

    @property
    def k_len(self) -> np.ndarray:
        """Each sequence's (batch entry's) keys."""
        return np.asarray(self.p.k_lens if self.mode == "batch" else self.starts[3], np.int64)

    @property
    def empty(self) -> bool:
        """Nothing to compute: no query row or no key anywhere."""
        p = self.p
        if p.sq == 0 or p.sk == 0 or p.batch == 0:
            return True
        return not ((self.q_len > 0) & (self.k_len > 0)).any()

    @property
    def out_shape(self) -> tuple:
        p = self.p
        if self.mode != "batch":
            return (p.sq, p.hq, p.dv)
        return (p.batch, p.hq, p.sq, p.dv) if p.layout == "bhsd" else (p.batch, p.sq, p.hq, p.dv)

    @property
    def lse_shape(self) -> tuple:
        p = self.p
        return (p.batch, p.hq, p.sq) if self.mode == "batch" else (p.hq, int(self.starts[5]))

    def empty_result(self):
        """0 out and -inf LSE in the problem's shapes (``empty_result``)."""
        return empty_result(self.p, self.out_shape, self.lse_shape)


@dataclasses.dataclass(frozen=True)
class Refused:
    """Why a path does not take a problem."""

    reasons: tuple[str, ...]


class Call:
    """A path's call with everything but the tensors fixed. ``entry``: the module function it
    runs (None for several); ``run(module, q, k, v, keep)`` returns (out, lse) in the problem's
    shapes (``Problem.out_shape`` / ``lse_shape``), numpy or, with ``keep``, DeviceTensors."""

    entry: str | None
    note: str
    replayable = True  # a call on DeviceTensors may be kept and run again (``prepared``)

    def run(self, module, q, k, v, *, keep: bool):  # pragma: no cover - an interface
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class EmptyCall(Call):
    """A problem with nothing to compute (no query row or no key it may see): 0 out, -inf LSE."""

    prob: Problem
    entry: str | None = None
    note: str = "nothing to compute: no function is called"
    replayable = False

    def run(self, module, q, k, v, *, keep: bool):
        return self.prob.empty_result()


def shaped(x, shape: tuple):
    """``x`` (numpy or a DeviceTensor) with ``shape``; as it is where it has it already (a
    DeviceTensor's reshape makes a new view object: every replayed call pays it)."""
    return x if tuple(x.shape) == shape else x.reshape(shape)


def empty_result(p: BatchProblem, out_shape, lse_shape):
    """0 out and -inf LSE of these shapes, on the inputs' device where they are DeviceTensors."""
    out, lse = np.zeros(out_shape, ABI_DTYPES[p.q.dtype]), np.full(lse_shape, -np.inf, np.float32)
    if p.q.on_device:
        uri = p.q.array.device_uri
        return DeviceTensor.from_host(out, p.q.dtype, uri), DeviceTensor.from_host(lse, "f32", uri)
    return out, lse
