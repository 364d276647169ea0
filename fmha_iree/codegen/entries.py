"""The manifest's table of a module's entry points (each function's arguments and results: shape,
dtype, ``?`` a runtime size; and what problems it takes) and its capabilities record
(``paths.capabilities``), from the same parameters ``source.py`` renders the module from. Written
into every module's manifest (``compile.build_artifact``) and checked against the loaded
module's functions (``api``, ``deploy``).
"""

from __future__ import annotations

import dataclasses

from ..problem.abi import (PACKED_SCALARS, PLAN_DESC_COLUMNS, PREFIX_SCALARS, RAGGED_SCALARS, ROWS_DESC_COLUMNS,
                  ROWS_PACKED_DESC_COLUMNS, TILE_COLUMNS, TILE_STEP, UNIT_TILE_COLUMNS)
from .source import dense_params, fwd_plan, has_plan, is_fused, step_compute
from ..problem.spec import KernelSpec
from ..problem.tiles import CPU_WAVE_KEYS, CPU_WAVE_ROWS, varlen_rows

__all__ = ["entry_points", "capabilities"]


def capabilities(spec: KernelSpec, *, fused_step: bool | None = None) -> dict:
    """The manifest's ``capabilities`` record (``paths.capabilities.Capabilities.from_record``):
    what the paths need to know of the module, and nothing they would have to probe it for.
    ``fused_step=True`` on the CPU: the GPU formulation built for llvm-cpu (tests)."""
    gpu = is_fused(spec, fused_step)
    t = spec.tiles
    return {"module": spec.module_name, "formulation": "gpu" if gpu else "cpu",
            "family": spec.target.family, "layout": spec.layout, "dtype": spec.dtype, "group": spec.group,
            "dq": spec.dq, "dv": spec.dv,
            "tiles": {"kM0": t.m0, "kN0": t.n0, "kK0": t.k0, "kN1": t.n1, "kK1": t.k1, "kv_chunk": t.kv_chunk},
            "entries": sorted(entry_points(spec, fused_step=fused_step)), **({"alibi": True} if spec.alibi else {}),
            **({"bias": True} if spec.bias else {}), "unit_rows": 0 if gpu else varlen_rows(t),
            "dense": dense_record(spec, fused_step=fused_step),
            "key_tiles": tiles_record(spec, fused_step=fused_step)}


def dense_record(spec: KernelSpec, *, fused_step: bool | None = None) -> dict | None:
    """The capabilities record's ``dense`` part (``paths.capabilities.DenseCaps``), or None."""
    d = dense_params(spec, fused_step=fused_step)
    if d is None:
        return None
    return {"align": d["align"], "seqlens": sorted(d["seqlens"]), "causal_o": sorted(d["causal_o"]),
            "tiled": d["tiled"], "dynamic": d["dynamic"],
            "batch": d.get("batch", 0), "kv_heads": d.get("kv_heads", 0)}


def tiles_record(spec: KernelSpec, *, fused_step: bool | None = None) -> dict | None:
    """The capabilities record's ``key_tiles`` part: ``fwd_tiles``' static sizes for the host's
    table (``paths.capabilities.TilesCaps``), where the module has it."""
    from .kernels.tiles import STEP, tiles_shape

    plan = fwd_plan(spec, fused_step=fused_step)
    t = tiles_shape(plan) if plan is not None else None
    if t is None:
        return None
    short = tiles_shape(plan, short=True) if spec.tiles_only else None  # kernels.tiles.tiles_module's short tiles
    return {"rows": t.rows, "group": t.group, "ew": t.ew, "step": STEP,
            **({"short_rows": short.rows, "short_ew": short.ew} if short is not None else {})}


@dataclasses.dataclass(frozen=True)
class _Io:
    """What the entry points of one spec share: the storage type ``t`` (bf16 as its int16 bits),
    ``hq`` (query heads as the manifest writes them), the q / k / v / out shapes in the module's
    layout (``?`` runtime sizes), and the online-softmax state's shapes."""

    spec: KernelSpec

    @property
    def t(self) -> str:
        return "i16(bf16 bits)" if self.spec.dtype == "bf16" else self.spec.dtype

    @property
    def hq(self) -> str:
        return "?" if self.spec.group == 1 else f"{self.spec.group}*Hk"

    def seq(self, h, d, s="?") -> list:
        return ["?", h, s, d] if self.spec.layout == "bhsd" else ["?", s, h, d]

    def qkv(self, t: str | None = None, h: str | None = None) -> dict:
        """q / k / v args, typed ``t`` (the storage type by default); ``h`` the heads of all three."""
        sp, t = self.spec, t or self.t
        return {"q": [self.seq(h or self.hq, sp.dq), t], "k": [self.seq(h or "Hk", sp.dq), t],
                "v": [self.seq(h or "Hk", sp.dv), t]}

    def out_lse(self) -> dict:
        return {"out": [self.seq(self.hq, self.spec.dv), self.t], "lse": [["?", self.hq, "?"], "f32"]}

    def state(self) -> dict:
        gr = self.spec.group * self.spec.tiles.m0
        return {"acc": [["?", "Hk", gr, self.spec.dv], "f32"], "m": [["?", "Hk", gr], "f32"], "l": [["?", "Hk", gr], "f32"]}


def entry_points(spec: KernelSpec, *, fused_step: bool | None = None) -> dict:
    """The module's functions and argument shapes/dtypes; ``?`` marks a runtime (dynamic) size."""
    io = _Io(spec)
    if spec.tiles_only:  # fwd_tiles alone, also on short tiles (kernels.tiles.tiles_module)
        plan = fwd_plan(spec, fused_step=True)
        out = _tiles_entry_point(spec, plan, io.t, io.seq, io.hq)
        short = _tiles_entry_point(spec, plan, io.t, io.seq, io.hq, short=True)
        return {**out, **{k.replace("fwd_tiles", "fwd_tiles_short"): e for k, e in short.items()}}
    out = _plan_entry_points(io) if has_plan(spec, fused_step=fused_step) else {}
    plan = fwd_plan(spec, fused_step=fused_step)
    if plan is not None:
        out.update(_one_call_entry_points(io, plan))
    gpu = is_fused(spec, fused_step)
    if not gpu:
        out.update(_cpu_entry_points(io, out["step"]))
    out.update(_dense_entry_points(spec, io.t, io.seq, io.hq, fused_step))
    return out


def _plan_entry_points(io: _Io) -> dict:
    """The host-driven tile plan's ``init`` / ``step`` / ``finalize``."""
    spec, state = io.spec, io.state()
    # the step template takes bf16 typed as bf16 on GPUs, as its int16 bits on the CPU (as the torch graphs do)
    cpu = spec.target.backend == "llvm-cpu"
    st = io.t if cpu else spec.dtype
    step = {"args": {**io.qkv(st), "scale": [[1], "f32"], **state, "desc": [["P", len(PLAN_DESC_COLUMNS)], "i32"]},
            "results": state, "desc_columns": list(PLAN_DESC_COLUMNS)}
    if not cpu:  # head dims 96 / 192 computed zero-padded (source.step_compute)
        step = {"compute_head_dims": list(step_compute(spec)[0]), **step}
    return {
        "init": {"args": {"carrier": [["NT", "Hk"], "i32"]}, "results": state},
        "step": step,
        "finalize": {
            "args": {**state, "out_map": [["?", "?"], "i32"], "lse_map": [["?", "?"], "i32"]},
            "results": io.out_lse(),
        },
    }


def _one_call_entry_points(io: _Io, plan) -> dict:
    """The GPU formulation's one-call entry points: ``fwd``, ``fwd_ragged``, ``fwd_tiles`` and (bshd,
    no padded head dims) the packed ones."""
    spec, t, hq = io.spec, io.t, io.hq
    lay = "[B, Hq, Sq, D]" if spec.layout == "bhsd" else "[B, Sq, Hq, D]"
    out = {"fwd": {
        "compute_head_dims": [plan.dq, plan.dv],  # wider than the arguments': zero-padded inside
        "args": {**io.qkv(), "scale": [[], "f32 scalar"], "y": [[], "i64 scalar"], "x": [[], "i64 scalar"]},
        "results": {**io.out_lse(),
                    "scratch": [(["padded K", "padded V"] if plan.kv_slots else []) + ["padded Q", "edge masks", "acc",
                                                                                  "max", "sum"], "dropped by the caller"]},
        "note": (f"any Sq, Sk >= 1 and any CK mask in one call ({lay} layout): row s sees keys "
                 "s - y + 1 <= j < s + x (CK's coordinates, clipped to [-Sk, Sq + 1] / [-Sq, Sk + 1]); "
                 "batch lengths uniform (no cu_seqlen padding)"),
    }}
    frame_args = {**io.qkv(h="?"), "idx": [["L"], "i32"], "scale": [[], "f32 scalar"],
                  **{n: [[], "i64 scalar"] for n in RAGGED_SCALARS}}
    out["fwd_ragged"] = {
        "args": {**frame_args, **{n: [[], "i64 scalar"] for n in PREFIX_SCALARS}},
        "results": {**io.out_lse(), "scratch": [["frames", "padded Q", "edge masks", "state"], "dropped by the caller"]},
        "note": ("sequences of their own lengths and CK mask in one padded frame (group mode, cu_seqlen "
                 "padding, paged caches); q / k / v read as rows n * R + r; the index table and the "
                 "scalars as fmha_iree.frames.Frame.table() writes them (fmha_iree/codegen/kernels/ragged.py)"),
    }
    out.update(_tiles_entry_point(spec, plan, t, io.seq, hq))
    if spec.layout == "bshd" and not plan.pads:
        out.update(_gpu_packed_entry_points(io, frame_args))
    return out


def _gpu_packed_entry_points(io: _Io, frame_args: dict) -> dict:
    """``fwd_packed`` and its paged forms (``kernels.packed``)."""
    out = {}
    for name, extra, note in (
            ("fwd_packed", (), "K / V read in place as pieces of W rows (fwd_ragged's problem when "
                              "the keys are the rows of k / v one sequence after the other)"),
            ("fwd_packed_paged", ("NU", "PG"), "the sequences' keys gathered as pages of PG rows in "
                                                "sequence order (a paged cache, runs with gaps), then as "
                                                "fwd_packed"),
            ("fwd_packed_pages", ("NU", "PG"), "a paged cache's pages (PG a multiple of 64 keys) read in "
                                                "place, four 64-row sub-pages a piece, each sequence's last "
                                                "sub-page copied with the rows it does not own zeroed")):
        args = dict(frame_args)
        args.update({n: [[], "i64 scalar"] for n in PACKED_SCALARS + extra})
        out[name] = {"args": args, "results": {**io.out_lse(),
                                               "scratch": [["pieces", "mask", "state"], "dropped by the caller"]},
                     "note": note + "; the table and scalars as fmha_iree.frames.Pieces writes them "
                                    "(fmha_iree/codegen/kernels/packed.py)"}
    return out


def _cpu_entry_points(io: _Io, step: dict) -> dict:
    """A CPU module's ``rows`` / ``rows_kpad``, ``units``, ``waves_varlen``, ``units_varlen``
    (bshd), ``step_open`` and (bshd) ``rows_packed`` / ``rows_packed_pages``."""
    spec, t, hq = io.spec, io.t, io.hq
    rows = {"args": {**io.qkv(), "scale": [[1], "f32"], "desc": [["B", len(ROWS_DESC_COLUMNS)], "i32"]},
            "results": io.out_lse(), "desc_columns": list(ROWS_DESC_COLUMNS)}
    why = ("any lengths and CK mask, whole key rows (short queries): row i of batch b sees key j iff "
           "i < qlen[b], j < klen[b] and i - y[b] + 1 <= j < i + x[b]")
    out = {"rows": {**rows, "note": why + "; klen[b] == Sk for every batch"},
           "rows_kpad": {**rows, "note": why + "; V past klen[b] is never read"}}
    out["units"] = {
        "args": {**io.qkv(), "scale": [[], "f32 scalar"], "y": [[], "i64 scalar"], "x": [[], "i64 scalar"]},
        "results": io.out_lse(),
        "note": (f"any Sq, Sk >= 1 and any CK mask in one call: row s sees keys s - y + 1 <= j < s + x; "
                 f"units of {spec.tiles.m0} rows x {spec.tiles.kv_chunk} keys looped inside the module "
                 "(mlir_templates.unit_loop); batch lengths uniform (no cu_seqlen padding)"),
    }
    out["waves_varlen"] = {
        "args": {**io.qkv(), "chunks": [["NC", 2], "i32"], "slots": [["NS", 2], "i32"],
                 "steps": [["NT", 4, "NS"], "i32"], "rowslot": [[spec.group, "B*S"], "i32"],
                 "levels": [["L", 3], "i64 host buffer"], "scale": [[], "f32 scalar"]},
        "results": {"out": [io.seq(hq, spec.dv), t], "lse": [["B", hq, "S"], "f32"]},
        "note": (f"sequences of packed tokens t = b S + s (group mode: B = 1) in one call, {CPU_WAVE_ROWS}-row "
                 f"slots of every sequence advancing a {CPU_WAVE_KEYS}-key chunk per step "
                 "(fmha_iree.problem.plan.wave_tables; the tables' layout in mlir/unit_waves.mlir.in), rows of no slot "
                 "0 (lse -inf)"),
    }
    if spec.layout == "bshd":
        out["units_varlen"] = {
            "args": {"q": [[1, "Tq", hq, spec.dq], t], "k": [[1, "Tk", "Hk", spec.dq], t],
                     "v": [[1, "Tk", "Hk", spec.dv], t], "tiles": [["N", 8], "i64 host buffer"],
                     "scale": [[], "f32 scalar"]},
            "results": {"out": [[1, "Tq", hq, spec.dv], t], "lse": [[1, hq, "Tq"], "f32"]},
            "tile_columns": list(UNIT_TILE_COLUMNS),
            "note": (f"group mode's packed sequences in one call: a table of {varlen_rows(spec.tiles)}-row tiles "
                     "(fmha_iree.problem.plan.unit_tiles) looped inside the module, rows of no tile 0 (lse -inf)"),
        }
    out["step_open"] = {**step, "note": "step for units whose R rows all see the C keys of their "
                                        "chunk (no mask; fmha_iree.problem.plan.Block.unmasked)"}
    if spec.layout == "bshd":
        out.update(_packed_entry_points(spec, t, hq))
    return out


def _tiles_entry_point(spec: KernelSpec, plan, t: str, seq, hq: str, short: bool = False) -> dict:
    """``fwd_tiles`` where the module has it (``kernels.tiles``; ``short``: its short tiles)."""
    from .kernels.tiles import tiles_shape

    shape = tiles_shape(plan, short)
    if shape is None:
        return {}
    scratch = ["edge mask", "edge K", "edge V", "acc", "max", "sum", "tiles' out", "tiles' LSE"]
    out = {"fwd_tiles": {
        "args": {"q": [seq("?", spec.dq), t], "k": [seq("?", spec.dq), t], "v": [seq("?", spec.dv), t],
                 "idx": [["L"], "i32"], **({"slopes": [["SR*Hq"], "f32"]} if spec.alibi else {}),
                 **({"bias": [["P", "?", "?"], t]} if spec.bias else {}),
                 "scale": [[], "f32 scalar"], "N": [[], "i64 scalar"],
                 "NL": [[], "i64 scalar"], "RL": [[], "i64 scalar"], "E": [[], "i64 scalar"]},
        "results": {"out": [seq(hq, spec.dv), t], "lse": [["NL", hq, "RL"], "f32"],
                    "scratch": [scratch + (["tiles' Q"] if spec.group > 1 or spec.tiles_only else []),
                               "dropped by the caller"]},
        "rows": shape.rows, "edge_keys": shape.ew, "edge_parts": shape.parts, "key_step": TILE_STEP,
        "table_columns": list(TILE_COLUMNS),
        "note": (f"tiles of {shape.rows} query rows (G heads of a KV head as rows), each over its own keys: "
                 f"idx holds the table [N, {len(TILE_COLUMNS)}] longest first, then each out row's tile row (B * Sq) and each LSE "
                 "row's (NL * RL), -1 for rows no sequence owns (fmha_iree.key_tiles.tile_table); a tile's "
                 "rows all see keys [0, nk) of its sequence, some see [nk, nk + ne)"),
    }}
    if spec.alibi:
        out["fwd_tiles"]["args"]["AL"] = [[], "i64 scalar"]
        out["fwd_tiles"]["alibi"] = ("slopes: ALiBi slopes, row sr of the table's per tile; AL: the length of the "
                                     "interior's bias ramps (codegen.kernels.tile_io.alibi_ramps)")
    if spec.bias:
        out["fwd_tiles"]["args"]["HS"] = [[], "i64 scalar"]
        out["fwd_tiles"]["bias"] = ("bias: planes [P, positions * G, keys] (fmha_iree.problem.bias), the tile's plane "
                                    "sr + HS * (its KV head), its rows from pos0 * G")
    if spec.layout == "bshd":
        e = out["fwd_tiles"]
        tail = [n for n in ("AL", "HS") if n in e["args"]]  # after TK
        args = {k: v for k, v in e["args"].items() if k not in tail}
        out["fwd_tiles_paged"] = {
            **e, "args": {**args, "TK": [[], "i64 scalar"], **{n: e["args"][n] for n in tail}},
            "results": {**e["results"], "scratch": [e["results"]["scratch"][0] + ["gathered K", "gathered V"],
                                                    "dropped by the caller"]},
            "note": ("fwd_tiles over a paged cache: k / v the cache's rows [1, pages * page, Hk, D], the table "
                     "ending with the cache row of each of the TK used keys in sequence order "
                     "(fmha_iree.key_tiles.paged_call), gathered first")}
    return out


def _dense_entry_points(spec: KernelSpec, t: str, seq, hq: str, fused_step: bool | None) -> dict:
    """The one-call entry points of ``entry_points``: compiled-in CPU row blocks, or the GPU
    templates (``dense`` and the per-length entries)."""
    out = {}
    dense = dense_params(spec, fused_step=fused_step)
    if dense and not dense["tiled"]:
        for s in sorted(dense["seqlens"]):
            io = {"q": [seq(hq, spec.dq, s), t], "k": [seq("Hk", spec.dq, s), t], "v": [seq("Hk", spec.dv, s), t]}
            res = {"out": [seq(hq, spec.dv, s), t], "lse": [["?", hq, s], "f32"]}
            out[f"dense_s{s}"] = {"args": {**io, "scale": [[1], "f32"]}, "results": res,
                                  "note": f"every row sees every key; Sq == Sk == {s} (row blocks of plain matmul/softmax)"}
            out[f"causal_s{s}"] = {"args": {**io, "scale": [[1], "f32"]}, "results": res,
                                   "note": f"row i sees keys j <= i; Sq == Sk == {s} (row blocks, keys up to the diagonal)"}
            for kind in ("dense", "causal"):
                out[f"{kind}_o_s{s}"] = {"args": {**io, "scale": [[1], "f32"]}, "results": {"out": res["out"]},
                                         "note": f"as {kind}_s{s}, without lse"}
    elif dense:
        a = dense["align"]
        tiled = lambda h, d: ["?", h, f"S/{a}", a, d] if spec.layout == "bhsd" else ["?", f"S/{a}", a, h, d]  # noqa: E731
        tt = spec.dtype  # the templates take bf16 typed as bf16 (the torch entry points take i16 bits)
        io = {"q": [tiled(hq, spec.dq), tt], "k": [tiled("Hk", spec.dq), tt], "v": [tiled("Hk", spec.dv), tt]}
        res = {"out": [tiled(hq, spec.dv), tt], "lse": [["?", hq, f"S/{a}", a], "f32"]}
        # caller-owned storage for the intermediates; its size in bytes is what the exported
        # `<name>_transients_size` returns for the same arguments (mlir_templates.dense._dense_common)
        io_s = {**io, "scale": [[1], "f32"], "workspace": [["<name>_transients_size"], "hal.buffer"]}
        out["dense"] = {"args": io_s, "results": res,
                        "note": f"every row sees every key; Sq, Sk multiples of {a}"}
        for s in sorted(dense["seqlens"]):
            fix = lambda shp: [s // a if x == f"S/{a}" else x for x in shp]  # noqa: E731
            sio = {n: [fix(shp), ty] for n, (shp, ty) in io_s.items()}
            sres = {n: [fix(shp), ty] for n, (shp, ty) in res.items()}
            out[f"dense_o_s{s}"] = {"args": sio, "results": {"out": sres["out"]},
                                    "note": f"every row sees every key, no lse (IREE's fused attention op); Sq == Sk == {s}"}
            if s in dense["causal_o"]:
                out[f"causal_o_s{s}"] = {"args": sio, "results": {"out": sres["out"]},
                                         "note": f"row i sees keys j <= i, no lse (fused attention op, masked); Sq == Sk == {s}"}
    return out


def _packed_entry_points(spec: KernelSpec, t: str, hq: str) -> dict:
    """A bshd CPU module's ``rows_packed`` / ``rows_packed_pages`` (``mlir_templates.rows_packed``)."""
    tok = lambda h, d: ["1", "?", h, d]  # noqa: E731
    res = {"out": [["n", "mq", hq, spec.dv], t], "lse": [["n", hq, "mq"], "f32"]}
    common = {"scale": [[1], "f32"], "desc": [["n", len(ROWS_PACKED_DESC_COLUMNS)], "i32"]}
    scalars = {"mq": [[], "i64 scalar"], "mk": [[], "i64 scalar"]}
    why = ("short queries of packed sequences (group mode), each against its own keys and CK mask; "
           "rows past a sequence's qlen are padding")
    return {
        "rows_packed": {"args": {"q": [tok(hq, spec.dq), t], "k": [tok("Hk", spec.dq), t], "v": [tok("Hk", spec.dv), t],
                                 **common, **scalars}, "results": res,
                        "desc_columns": list(ROWS_PACKED_DESC_COLUMNS), "note": why + "; K / V read in place"},
        "rows_packed_pages": {"args": {"q": [tok(hq, spec.dq), t], "k_cache": [["pages", "P", "Hk", spec.dq], t],
                                       "v_cache": [["pages", "P", "Hk", spec.dv], t], **common,
                                       "block_table": [["n", "max_pages"], "i32"], **scalars},
                              "results": res, "desc_columns": list(ROWS_PACKED_DESC_COLUMNS),
                              "note": why + "; key j of sequence b is row j % P of page block_table[b, j // P] "
                                            "(desc's k_start unused)"},
    }
