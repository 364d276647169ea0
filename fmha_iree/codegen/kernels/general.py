"""``fwd``: batch-mode attention for any lengths and any CK mask in one call (runtime lengths).

Signature (``layout`` "bhsd" shown; "bshd" swaps the S and H axes of q, k, v and out)::

    fwd(q [B, Hq, Sq, Dq], k [B, Hk, Sk, Dq], v [B, Hk, Sk, Dv], scale: f32, y: i64, x: i64)
        -> (out [B, Hq, Sq, Dv], lse [B, Hq, Sq] f32, scratch...)

``(y, x)`` are CK's mask coordinates for this problem (row ``s`` sees keys
``s - y + 1 <= j < s + x``); every size is a runtime value. Q is copied once into padded rows
``(s, g)`` per KV head (so the G query heads of a KV head share every K/V tile); K and V are read
in place. The function's index arithmetic (run by IREE on the host) cuts the problem:

* prefill: rows in groups of ``R`` (``Plan.rows``, raised so that at most ``Plan.max_groups``
  groups cover Sq; all of Sq when no row is limited). Per group one op over its interior (no mask,
  ``L``-key columns) and, chained through the online-softmax state, one masked op per non-empty
  edge (``bounds``); masked-out key blocks outside a group's union are never read.
* split-KV (one group with too few workgroups to fill the GPU, e.g. decode): the interior cut into
  ``P`` pieces as a batch dim (plus single leftover columns), each piece and edge writing its own
  state slot, slots merged through their max/sum (``finalize.normalize_slots``).
* short queries (``Sq * G <= Plan.short_rows``) take the split-KV path with their own lowering
  (``Plan.short``: 16-row tiles).
* banded (``Plan.banded``; a window whose band of keys is at most half of Sk, and groups enough
  for two waves of workgroups): ``kernels.banded``, every group of rows over the key pages of its
  band, all groups in one op per range of slots, pages gathered inside the op (K / V read in
  place where Sk is a multiple of ``Plan.cols``, else copied to whole pages).

Edges are computed over windows whose key counts are multiples of ``Plan.cols``
(``bounds.edge_window``); a problem whose widest window does not fit in Sk (an edge spanning nearly
all of a short Sk) runs one group over copies of K and V padded to a multiple of ``Plan.cols``.

The host picks one path (an ``scf.if`` chain over straight-line variants: each group count with
or without left edges, split-KV with or without leftover columns, the padded fallback) and each
path is the whole call:
its own Q copy, masks, state, ops and normalize. A call is then one execution region whose
allocations wait on nothing but its inputs. The tensors it works in (``scratch``: padded Q, masks,
state) are returned after ``lse`` and dropped by the caller: as results they are allocated like
the outputs and freed when released; as transients, IREE 3.13's CUDA HAL would free them with a
host wait for the call's last kernel (its ``queue_dealloca`` blocks on its semaphores), so the host
could not queue a call before the one before it had finished. (A caller-owned workspace,
``iree.abi.transients``, miscompiled here: IREE 3.13's transient emplacement placed offset
arithmetic inside an execution region.)
"""

from __future__ import annotations

from .attention import Operand
from .bounds import Coords
from .general_paths import body
from .ir import Fn, tensor_type
from .operands import Ctx, Plan, Tier

__all__ = ["Tier", "Plan", "render_fwd", "fwd_body"]

def fwd_body(fn: Fn, p: Plan, q: str, k: str, v: str, coords, desc: tuple[str, str] | None = None,
             sizes: tuple[str, ...] | None = None, frame=None) -> list[tuple[str, str]]:
    """Emit ``fwd``'s work on the tensors ``q`` / ``k`` / ``v`` (the plan's types and layout) into
    ``fn`` with the coordinates ``coords()`` returns (a ``Coords``; and, ragged, the ``[4, B]``
    descriptor at ``desc``: (1-D tensor, offset)); ``sizes`` (B, Sq, Hq, Sk, Hk) as host values
    (``Fn.bounded``) where the tensors are made in the function (else read from them), ``frame`` what makes them in
    each path (``Ctx.frame``, at the plan's head dims). Returns its results (name, type): out, lse,
    scratch."""
    T, (D, DV) = p.dtype, (p.arg_dims if frame is None else (p.dq, p.dv))
    ty_q, ty_k, ty_v = tensor_type(["?", "?", "?", D], T), tensor_type(["?", "?", "?", D], T), tensor_type(["?", "?", "?", DV], T)
    s_ax, h_ax = (2, 1) if p.layout == "bhsd" else (1, 2)
    # sizes below 2**31 (every tensor of a validated problem fits in memory): IREE then passes
    # derived sizes as single 32-bit push constants (fewer scalar registers per dispatch)
    dims = ((q, ty_q, 0), (q, ty_q, s_ax), (q, ty_q, h_ax), (k, ty_k, s_ax), (k, ty_k, h_ax))
    b, sq, hq, sk, hk = sizes or (fn.bounded(fn.dim(*dim)) for dim in dims)
    if sizes is None:
        # the arguments re-tied to those bounded sizes: every dispatch then reads one 32-bit
        # value per size (not K's and V's own 64-bit dims apiece), which keeps the masked edge
        # kernels within gfx90a's scalar registers
        order = lambda h, s: (b, h, s) if s_ax == 2 else (b, s, h)  # noqa: E731
        q, k, v = (_retied(fn, val, ty, order(h, s)) for val, ty, h, s in
                   ((q, ty_q, hq, sq), (k, ty_k, hk, sk), (v, ty_v, hk, sk)))
    co = coords()
    scale = "%scale" if T == "f32" else fn.arith(f"arith.truncf %scale : f32 to {T}", "sc")
    kd = ("b0", "b1", "k2", "k1") if p.layout == "bhsd" else ("b0", "k2", "b1", "k1")
    vd = kd[:3] + ("n",)
    c = Ctx(fn, p, b, hk, hq, sq, sk, co, scale, Operand(k, ty_k, kd), Operand(v, ty_v, vd), sk, desc=desc, q=q,
            frame=frame)
    return body(c)


def _retied(fn: Fn, value: str, ty: str, dims: tuple[str, str, str]) -> str:
    """``value`` (a rank-4 tensor with three dynamic dims) as the same tensor with ``dims``."""
    own = ", ".join(fn.dim(value, ty, i) for i in range(3))
    return fn.let(f"flow.tensor.reshape {value} : {ty}{{{own}}} -> {ty}{{{', '.join(dims)}}}", "t")


def render_fwd(plan: Plan, func_name: str = "fwd") -> str:
    """The MLIR text of ``util.func public @func_name`` (see the module docstring)."""
    fn = Fn()
    p = plan
    T, (D, DV) = p.dtype, p.arg_dims
    ty_q, ty_k, ty_v = tensor_type(["?", "?", "?", D], T), tensor_type(["?", "?", "?", D], T), tensor_type(["?", "?", "?", DV], T)
    idx = lambda name: fn.arith(f"arith.index_cast %{name} : i64 to index", name)  # noqa: E731
    results = fwd_body(fn, p, "%q", "%k", "%v", lambda: Coords.uniform(idx("y"), idx("x")))
    names, types = ", ".join(n for n, _ in results), ", ".join(t for _, t in results)
    args = f"%q: {ty_q}, %k: {ty_k}, %v: {ty_v}, %scale: f32, %y: i64, %x: i64"
    return (f"util.func public @{func_name}({args}) -> ({types}) {{\n" + fn.text()
            + f"\n  util.return {names} : {types}\n}}\n")
