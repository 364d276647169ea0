"""CPU modules' group mode (``cpu_group``): packed sequences in a few calls, each reading K / V in
place over the span of rows its sequences occupy: sequences of a few query rows in ``rows_packed``
groups (``paths.cpu_short``), the others up to ``WAVE_MAX_ROWS`` rows in one ``waves_varlen`` call
(slots of every sequence advancing a chunk of keys per step, ``plan.wave_tables``), the longer ones
in one ``units_varlen`` call (``plan.unit_tiles``). A host batch-mode problem takes the same calls
where they were measured faster (each batch entry a sequence: ``batch_as_group``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..problem.abi import CPU_WAVE_KEYS, CPU_WAVE_ROWS
from ..problem.plan import runs, unit_tiles, wave_tables
from ..runtime.module import Host, Upload
from ..problem.spec import BatchProblem
from .base import Call, Problem, Refused, empty_result
from .capabilities import Capabilities
from .cpu_short import rows_group, short_sequences
from .frame import descriptors
from .policy import BATCH_WAVE_MAX_KEYS, BATCH_WAVE_MIN_ROWS, ROWS_MAX_ROWS, ROWS_MAX_SCORES, WAVE_MAX_ROWS

__all__ = ["CPU_GROUP", "varlen_calls", "batch_as_group"]


def _tables_call(module, fn: str, p: BatchProblem, qkv: tuple, tables: tuple = (), host: np.ndarray | None = None):
    """One call of a packed-sequence entry (``units_varlen``, ``waves_varlen``) on ``qkv``, its
    int32 ``tables`` uploaded, its int64 ``host`` table as a host buffer. Returns numpy (out, lse)."""
    d = p.q.dtype
    args = [(x, d) for x in qkv] + [Upload(t) for t in tables] + ([Host(host)] if host is not None else [])
    out, lse = module.call(fn, args, scalars=(float(p.scale),), results=[d, "f32"])
    return out, lse


def units_varlen_call(p: BatchProblem, module, seqs: np.ndarray, starts, rows: int):
    """The sequences ``seqs`` of a group-mode problem (with query rows; one without keys gets out 0
    and lse -inf from its tiles) in one ``units_varlen`` call over the span of packed rows and keys
    they occupy, read in place. Returns (out ``[Tq, Hq, Dv]``, lse ``[Hq, total]``) with ``seqs``'
    rows written and the others 0 / -inf, for the caller to write (``_collected``)."""
    total_q = starts[5]
    if not len(seqs):
        return empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    (q_start, q_len, k_start, k_len, lse_start), (qa, qb, ka, kb), desc = _span(p, seqs, starts)
    table = unit_tiles((q_start - qa, q_len, k_start - ka, k_len), (desc[:, 2], desc[:, 3]), rows=rows,
                       group=p.hq // p.hk)
    o, l = _tables_call(module, "units_varlen", p, (p.q.array[:, qa:qb], p.k.array[:, ka:kb], p.v.array[:, ka:kb]),
                        host=table)
    return _collected(p, (o[0], l[0]), (qa, qb), (q_start, q_len, lse_start), total_q)


def varlen_calls(p: BatchProblem, module, starts, rows: int):
    """A group-mode problem on a CPU module: each sequence to the call its own lengths choose, so
    its result is the same whatever it is batched with: a few query rows (``packed_fits``) in
    ``rows_packed`` groups of similar key counts (``short_sequences``), up to ``WAVE_MAX_ROWS``
    rows in one ``waves_varlen`` call, longer ones in one ``units_varlen`` call of ``rows``-row
    tiles. Returns (out ``[Tq, Hq, Dv]``, lse ``[Hq, total]``).

    Where long and short sequences interleave, the two calls each read K / V over the span their
    sequences occupy, so part of it twice: measured up to 8% slower than one kind for all on the dev
    CPU (docs/thresholds.md, "CPU waves against units"), the price of batch invariance."""
    q_len = starts[1]
    groups = short_sequences(p, q_len, starts[3]) if "rows_packed" in module.functions else []
    rest = q_len > 0
    for s in groups:
        rest[s] = False
    long = rest & (q_len > WAVE_MAX_ROWS)
    out = lse = None
    if long.any():
        out, lse = units_varlen_call(p, module, np.flatnonzero(long), starts, rows)
    out, lse = waves_call(p, module, np.flatnonzero(rest & ~long), starts, out, lse)
    for s in groups:
        rows_group(p, module, s, starts, out, lse)
    return out, lse


def waves_call(p: BatchProblem, module, seqs: np.ndarray, starts, out: np.ndarray | None = None,
               lse: np.ndarray | None = None):
    """The sequences ``seqs`` of a group-mode problem in one ``waves_varlen`` call over the span of
    packed rows and keys they occupy (read in place), their rows written into ``out`` / ``lse``
    (``[Tq, Hq, Dv]``, ``[Hq, total]``). Without ``out``, returns the call's own arrays where they
    are the problem's (its span is every packed row, each row's LSE column its own index: rows no
    sequence of ``seqs`` owns are 0 / -inf there), else new ones (``_collected``). Returns (out, lse)."""
    total_q = starts[5]
    if not len(seqs):
        return (out, lse) if out is not None else empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    (q_start, q_len, k_start, k_len, lse_start), (qa, qb, ka, kb), desc = _span(p, seqs, starts)
    o, l = _run_waves(p, module, (p.q.array[:, qa:qb], p.k.array[:, ka:kb], p.v.array[:, ka:kb]),
                      (q_start - qa, q_len, k_start - ka, k_len), desc, qb - qa)
    return _collected(p, (o[0], l[0]), (qa, qb), (q_start, q_len, lse_start), total_q, out, lse)


def _collected(p: BatchProblem, res: tuple, span: tuple[int, int], seqs: tuple, total_q: int,
               out: np.ndarray | None = None, lse: np.ndarray | None = None):
    """A call's results ``res`` (out ``[rows, Hq, Dv]``, lse ``[Hq, rows]`` over the packed rows
    ``span``, rows of no sequence of the call 0 / -inf) as the problem's (out, lse): the call's own
    arrays where its span is every packed row and each row's LSE column its own index, else its
    sequences' rows (``seqs`` = (q_start, q_len, lse_start)) written into ``out`` / ``lse`` (new
    ones, 0 / -inf, where not given)."""
    qa, qb = span
    if out is None:
        if (qa, qb) == (0, p.sq) and total_q == p.sq and np.array_equal(seqs[2], seqs[0]):
            return res
        out, lse = empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    _place(out, lse, res[0], res[1], qa, seqs)
    return out, lse


def _run_waves(p: BatchProblem, module, qkv: tuple, starts: tuple, desc: np.ndarray, total_q: int):
    """One ``waves_varlen`` call on ``qkv`` (tokens t = b S + s) for the sequences ``starts`` =
    (q_start, q_len, k_start, k_len) with descriptors ``desc`` (``frames.descriptors``), over
    ``total_q`` rows. Returns (out, lse) as the module gives them."""
    w = wave_tables(starts, (desc[:, 2], desc[:, 3]), total_q, rows=CPU_WAVE_ROWS, chunk=CPU_WAVE_KEYS,
                    group=p.hq // p.hk)
    return _tables_call(module, "waves_varlen", p, qkv, (w.chunks, w.slots, w.steps, w.rowslot), w.levels)


def _span(p: BatchProblem, seqs: np.ndarray, starts):
    """The sequences ``seqs``' (q_start, q_len, k_start, k_len, lse_start), the packed rows
    ``[qa, qb)`` and keys ``[ka, kb)`` they occupy (at least one key, inside the keys), and their
    descriptors (``frames.descriptors``)."""
    q_start, q_len, k_start, k_len, lse_start = (x[seqs] for x in starts[:5])
    qa, qb = int(q_start.min()), int((q_start + q_len).max())
    ka = min(int(k_start.min()), p.sk - 1)
    kb = max(int((k_start + k_len).max()), ka + 1)
    return (q_start, q_len, k_start, k_len, lse_start), (qa, qb, ka, kb), descriptors(p.mask, q_len, k_len)


def _place(out: np.ndarray, lse: np.ndarray, o: np.ndarray, l: np.ndarray, qa: int, seqs: tuple):
    """Rows of a call over packed rows from ``qa`` on (``o`` [rows, Hq, Dv], ``l`` [Hq, rows]) into
    the problem's ``out`` / ``lse``, for sequences ``seqs`` = (q_start, q_len, lse_start): one slice
    where they fill the call's rows in order, else row by row."""
    q_start, q_len, lse_start = seqs
    ends = np.cumsum(q_len)
    if np.array_equal(q_start, qa + ends - q_len) and np.array_equal(lse_start, q_start):
        n = int(ends[-1])
        out[qa:qa + n], lse[:, qa:qa + n] = o[:n], l[:, :n]
        return
    seq, rel = runs(q_len)
    out[q_start[seq] + rel] = o[q_start[seq] - qa + rel]
    lse[:, lse_start[seq] + rel] = l[:, q_start[seq] - qa + rel]


def batch_as_group(p: BatchProblem, module, rows: int):
    """A host batch (``cu_seqlen`` padding or not) as group mode, batch entry ``b`` the sequence of
    tokens ``[b Sq, b Sq + q_len[b])`` (keys ``[b Sk, b Sk + k_len[b])``). bshd: the batch viewed as
    ``[1, B S, H, D]`` through ``varlen_calls``, so each entry takes the calls its own lengths
    choose (the same result as that sequence in group mode); bhsd (every entry at most
    ``WAVE_MAX_ROWS`` rows): one ``waves_varlen`` call on the batch as it lies. Returns (out, lse
    ``[B, Hq, Sq]``), rows past ``q_len[b]`` 0 and -inf."""
    b, sq, sk = p.batch, p.sq, p.sk
    q_lens, k_lens = np.asarray(p.q_lens, np.int64), np.asarray(p.k_lens, np.int64)
    out_shape = (b, p.hq, sq, p.dv) if p.layout == "bhsd" else (b, sq, p.hq, p.dv)
    if not q_lens.any():  # no batch entry has query rows
        return empty_result(p, out_shape, (b, p.hq, sq))
    starts = (np.arange(b) * sq, q_lens, np.arange(b) * sk, k_lens, np.arange(b) * sq, b * sq)
    if p.layout == "bhsd":
        desc = descriptors(p.mask, p.q_lens, p.k_lens)
        return _run_waves(p, module, (p.q.array, p.k.array, p.v.array), starts[:4], desc, b * sq)
    flat = [dataclasses.replace(x, array=x.array.reshape((1, -1) + x.array.shape[2:])) for x in (p.q, p.k, p.v)]
    pf = dataclasses.replace(p, q=flat[0], k=flat[1], v=flat[2], batch=1, sq=b * sq, sk=b * sk,
                             q_lens=q_lens.sum(keepdims=True), k_lens=k_lens.sum(keepdims=True))
    o, l = varlen_calls(pf, module, starts, rows)
    return o.reshape(out_shape), l.reshape(p.hq, b, sq).transpose(1, 0, 2)


def _rows_fit(p: BatchProblem, caps: Capabilities) -> bool:
    """Whether ``rows`` takes the batch (``paths.rows``): it comes first where it does."""
    return caps.has("rows", "rows_kpad") and p.sq * (p.hq // p.hk) <= ROWS_MAX_ROWS and \
        p.batch * p.hq * p.sq * p.sk <= ROWS_MAX_SCORES


def _batch_reasons(prob: Problem, caps: Capabilities) -> list[str]:
    """Why a host batch does not run as group mode: it takes it where measured faster
    (``policy.BATCH_WAVE_MIN_ROWS``), and with cu_seqlen padding where ``rows`` does not take it."""
    p = prob.p
    waves, units = caps.has("waves_varlen"), caps.has("units_varlen")
    measured = waves and BATCH_WAVE_MIN_ROWS <= p.sq and p.sk <= BATCH_WAVE_MAX_KEYS and \
        (p.layout == "bshd" or p.sq <= WAVE_MAX_ROWS)
    padded = prob.padded and (p.layout == "bshd" and units or waves and p.sq <= WAVE_MAX_ROWS) and \
        not _rows_fit(p, caps)
    if measured or padded:
        return []
    return [f"measured faster elsewhere: as group mode from {BATCH_WAVE_MIN_ROWS} query rows against at most "
            f"{BATCH_WAVE_MAX_KEYS} keys (bhsd: at most {WAVE_MAX_ROWS} rows; policy.BATCH_WAVE_MIN_ROWS), or with "
            "cu_seqlen padding that rows does not take"]


@dataclasses.dataclass(frozen=True)
class _GroupCall(Call):
    """The CPU's group-mode calls on a host problem (never replayed: host arrays only)."""

    replayable = False

    prob: Problem
    rows: int
    entry: str | None = None
    note: str = ""

    def run(self, module, q, k, v, *, keep: bool):
        p = self.prob.p
        if self.prob.mode == "batch":
            return batch_as_group(p, module, self.rows)
        return varlen_calls(p, module, self.prob.starts, self.rows)


class _CpuGroup:
    name = "cpu_group"
    modes = ("batch", "group")

    def plan(self, prob: Problem, caps: Capabilities):
        found = [] if caps.has("waves_varlen") else [caps.missing("waves_varlen") + " (CPU modules have it)"]
        if prob.mode == "group" and not caps.has("units_varlen"):
            found.append(caps.missing("units_varlen") + " (bshd CPU modules have it)")
        if prob.on_device:
            found.append("the inputs are DeviceTensors: the CPU's group-mode calls read host arrays")
        if prob.mode == "batch" and not found:
            found += _batch_reasons(prob, caps)
        if found:
            return Refused(tuple(found))
        entry = None
        if prob.mode == "batch":
            waves = caps.has("waves_varlen") and int(prob.q_len.max()) <= WAVE_MAX_ROWS
            entry = "waves_varlen" if waves else "units_varlen"
        return _GroupCall(prob, caps.unit_rows, entry, "each sequence its own lengths and mask, K / V read in place")


CPU_GROUP = _CpuGroup()
