"""The one selector: for each mode an ordered list of paths; the first that does not refuse the
problem runs it. :func:`select` returns the :class:`Route`: the path taken, its call, and every path
before it with the reasons it refused (``str(route)`` says them).

Order, and why (each path's file says which rows it serves):

- batch: the compiled-in lengths (fastest where compiled), the aligned ``dense``; the CPU's group
  calls and ``rows`` where measured faster (``policy``); the GPU's ``tiles`` (cu_seqlen padding,
  long square causal), ``packed`` (decode-shaped padding), ``ragged`` (other padding); the general
  one-call ``units`` (CPU) and ``fwd`` (GPU); the host ``plan``.
- group: ``tiles``, ``packed`` (decode-shaped), ``ragged`` (what the tiles refuse), the CPU's group
  calls, the ``plan`` (DeviceTensors on a CPU module).
- paged: ``tiles`` (the used keys gathered), ``packed`` (pages read in place or gathered),
  ``ragged``; on the CPU ``cpu_pages`` (short sequences read through the block table), else
  ``cpu_gather`` (the used keys gathered on the host, then group mode).
"""

from __future__ import annotations

import dataclasses

from .base import Call, EmptyCall, Problem, Refused
from .capabilities import Capabilities
from .compiled_in import COMPILED_IN, DENSE
from .cpu_group import CPU_GROUP
from .cpu_gather import CPU_GATHER
from .cpu_short import CPU_PAGES
from .fwd import FWD, UNITS
from .packed import PACKED
from .plan import PLAN
from .ragged import RAGGED
from .rows import ROWS
from .tiles import TILES

__all__ = ["ORDER", "Route", "select", "NoPath"]

ORDER = {
    "batch": (COMPILED_IN, DENSE, CPU_GROUP, ROWS, TILES, PACKED, RAGGED, UNITS, FWD, PLAN),
    "group": (TILES, PACKED, RAGGED, CPU_GROUP, PLAN),
    "paged": (TILES, PACKED, RAGGED, CPU_PAGES, CPU_GATHER),
}


class NoPath(ValueError):
    """No path of the module takes the problem; the message lists every path's reasons."""


@dataclasses.dataclass(frozen=True)
class Route:
    """The path a problem takes on a module: ``path`` its name, ``entry`` the module function it
    calls (None for several, or none), ``why`` what the path does for this problem, ``rejected``
    each earlier path with the reasons it refused."""

    mode: str
    path: str
    entry: str | None
    why: str
    rejected: tuple = ()
    call: Call | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def reason(self) -> str:
        return self.why

    def __str__(self) -> str:
        lines = [f"{self.mode} mode: {self.path}" + (f" ({self.entry})" if self.entry else "") + f": {self.why}"]
        for name, reasons in self.rejected:
            lines.append(f"  not {name}: " + "; ".join(reasons))
        return "\n".join(lines)


def select(prob: Problem, caps: Capabilities | None) -> Route:
    """The first path of ``prob.mode``'s order that takes ``prob`` on a module of ``caps`` (None:
    an empty problem, for which nothing is loaded or called). :class:`NoPath` where none does."""
    if prob.empty or caps is None:
        call = EmptyCall(prob)
        return Route(prob.mode, "empty", None, call.note, (), call)
    if caps.alibi != (prob.p.alibi is not None):
        raise NoPath(f"alibi_slopes: module {caps.module} was built " + (
            "with ALiBi: give alibi_slopes" if caps.alibi else "without ALiBi (build one with --alibi)"))
    if caps.bias != (prob.p.bias is not None):
        raise NoPath(f"bias: module {caps.module} was built " + (
            "with a bias argument: give bias" if caps.bias else "without a bias (build one with --bias)"))
    rejected = []
    for path in ORDER[prob.mode]:
        ans = path.plan(prob, caps)
        if isinstance(ans, Refused):
            rejected.append((path.name, ans.reasons))
            continue
        return Route(prob.mode, path.name, ans.entry, ans.note, tuple(rejected), ans)
    lines = "\n".join(f"  {name}: " + "; ".join(reasons) for name, reasons in rejected)
    raise NoPath(f"module {caps.module} has no path for this {prob.mode}-mode problem:\n{lines}")
