"""CPU modules' short sequences: group mode's sequences of a few query rows in ``rows_packed`` calls
(``mlir_templates.rows_packed``: each query row against its own keys, K / V read where they lie),
grouped by key count; and the paged cache's ``cpu_pages`` path (every sequence short:
``rows_packed_pages`` reads the pages in place through the block table).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..problem.paged import PagedCache
from ..problem.plan import runs
from ..runtime.module import Const, Upload
from ..problem.spec import BatchProblem
from .base import Call, Problem, Refused
from .capabilities import Capabilities
from .frame import descriptors
from .policy import GROUP_KEYS, PACKED_MAX_QUERIES, PACKED_MAX_QUERIES_MHA, PACKED_MAX_ROWS, PAD_LIMIT, ROWS_MAX_SCORES

__all__ = ["CPU_PAGES", "packed_fits", "short_sequences", "rows_group"]


def packed_fits(max_qlen: int, group: int) -> bool:
    """Whether sequences of at most ``max_qlen`` query rows take ``rows_packed`` (``PACKED_MAX_QUERIES``)."""
    most = PACKED_MAX_QUERIES if group > 1 else PACKED_MAX_QUERIES_MHA
    return max_qlen <= most and max_qlen * group <= PACKED_MAX_ROWS


def short_sequences(p: BatchProblem, q_len: np.ndarray, k_len: np.ndarray) -> list[np.ndarray]:
    """Group mode: the sequences ``rows_packed`` takes (``packed_fits`` by their own query rows,
    at least one query and one key, at most ``ROWS_MAX_SCORES`` scores), in groups of similar key
    counts (``_closes_group``), each group's padded batch within ``ROWS_MAX_SCORES`` scores.
    Whether a sequence is here depends on it alone (a group's call computes each sequence against
    its own keys: the grouping does not change its result). Returns index arrays, one per call."""
    g = p.hq // p.hk
    fits = np.array([packed_fits(int(n), g) for n in q_len], bool)
    ok = np.flatnonzero(fits & (q_len > 0) & (k_len > 0) & (p.hq * q_len * k_len <= ROWS_MAX_SCORES))
    groups, cur, most_q, keys = [], [], 0, 0
    for i in ok[np.argsort(k_len[ok], kind="stable")]:  # ascending keys: the last one is the longest
        k_i = int(k_len[i])
        if cur and ((len(cur) + 1) * p.hq * max(most_q, int(q_len[i])) * k_i > ROWS_MAX_SCORES
                    or _closes_group(len(cur), keys, k_i)):
            groups.append(np.array(cur))
            cur, most_q, keys = [], 0, 0
        cur.append(i)
        most_q, keys = max(most_q, int(q_len[i])), keys + k_i
    return groups + ([np.array(cur)] if cur else [])


def _closes_group(n: int, keys: int, k_next: int) -> bool:
    """Whether a group of ``n`` sequences with ``keys`` keys in all stops before a sequence of
    ``k_next`` keys (at least as many as any in the group): padding all of them to ``k_next``
    would compute more than ``PAD_LIMIT`` times their own keys, and the group already holds
    ``GROUP_KEYS`` keys (a call's fixed cost is then small against its work)."""
    return (n + 1) * k_next > PAD_LIMIT * (keys + k_next) and keys >= GROUP_KEYS


def paged_groups(p: BatchProblem, starts) -> list[np.ndarray] | None:
    """The ``rows_packed_pages`` calls of a group-mode problem over a paged cache
    (:func:`short_sequences`' groups), or None where a sequence with work has more query rows
    than ``packed_fits`` takes (then every sequence is gathered: ``rows_packed`` over the
    gathered keys gives each short one the same result as over its pages)."""
    q_len, k_len = starts[1], starts[3]
    groups = short_sequences(p, q_len, k_len)
    left = (q_len > 0) & (k_len > 0)
    for group in groups:
        left[group] = False
    return None if left.any() else groups


def rows_group(p: BatchProblem, module, group: np.ndarray, starts, out: np.ndarray, lse: np.ndarray,
               cache: PagedCache | None = None):
    """Run the sequences ``group`` of a group-mode problem (each with at most ``packed_fits``'
    query rows) in one ``rows_packed`` call, K / V read where they lie (a paged ``cache`` through
    its block table: ``rows_packed_pages``), written back into the packed ``out`` ``[Tq, Hq, Dv]``
    and ``lse`` ``[Hq, total]``."""
    q_start, q_len, k_start, k_len, lse_start, _ = (x[group] if isinstance(x, np.ndarray) else x for x in starts)
    mq, mk = int(q_len.max()), int(k_len.max())
    desc = descriptors(p.mask, q_len, k_len)
    packed = np.concatenate([np.stack([q_start, q_len, k_start, k_len], 1), desc[:, 2:]], 1).astype(np.int32)
    kv = (cache.k.array, cache.v.array) if cache is not None else (p.k.array, p.v.array)
    args = [(p.q.array, p.q.dtype), (kv[0], p.q.dtype), (kv[1], p.q.dtype), Const(np.array([p.scale], np.float32), "f32"),
            Upload(packed)]
    if cache is not None:
        args.append(Upload(cache.block_table[group]))
    fn = "rows_packed" if cache is None else "rows_packed_pages"
    o, l = module.call(fn, args, scalars=(mq, mk), results=[p.q.dtype, "f32"])
    rows, rel = runs(q_len)
    out[q_start[rows] + rel] = o[rows, rel]
    lse[:, lse_start[rows] + rel] = l[rows, :, rel].T


@dataclasses.dataclass(frozen=True)
class _PagesCall(Call):
    """``rows_packed_pages`` calls over a paged cache, one per group (host arrays, never replayed)."""

    replayable = False

    prob: Problem
    groups: tuple
    entry: str = "rows_packed_pages"
    note: str = ""

    def run(self, module, q, k, v, *, keep: bool):
        p, starts = self.prob.p, self.prob.starts
        out, lse = self.prob.empty_result()
        for group in self.groups:
            rows_group(p, module, group, starts, out, lse, self.prob.cache)
        return out, lse


def host_reasons(prob: Problem, caps: Capabilities, *entries: str) -> list[str]:
    out = [] if caps.has(*entries) else [caps.missing(*entries) + " (bshd CPU modules have it)"]
    if prob.on_device:
        out.append("the inputs are DeviceTensors: the CPU's group-mode calls read host arrays")
    return out


class _CpuPages:
    name = "cpu_pages"
    modes = ("paged",)

    def plan(self, prob: Problem, caps: Capabilities):
        found = host_reasons(prob, caps, "rows_packed_pages")
        if found:
            return Refused(tuple(found))
        groups = paged_groups(prob.p, prob.starts)
        if groups is None:
            most = PACKED_MAX_QUERIES if prob.group > 1 else PACKED_MAX_QUERIES_MHA
            return Refused((f"a sequence has more query rows than rows_packed takes ({most}, at most {PACKED_MAX_ROWS} "
                            "per KV head: policy.PACKED_MAX_QUERIES)",))
        return _PagesCall(prob, tuple(groups), note="the pages read in place, short sequences grouped by key count")


CPU_PAGES = _CpuPages()
