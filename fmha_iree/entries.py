"""The manifest's table of a module's entry points: each function's arguments and results (shape,
dtype; ``?`` a runtime size) and what problems it takes, from the same parameters ``source.py``
renders the module from. Written into every module's manifest (``compile.build_artifact``) and
checked against the loaded module's functions (``api``, ``deploy``).
"""

from __future__ import annotations

import dataclasses

from .source import dense_params, fwd_plan, step_compute
from .spec import KernelSpec
from .tiles import CPU_WAVE_KEYS, CPU_WAVE_ROWS, varlen_rows

__all__ = ["entry_points", "dense_entry"]


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


def entry_points(spec: KernelSpec) -> dict:
    """The module's functions and argument shapes/dtypes; ``?`` marks a runtime (dynamic) size."""
    io = _Io(spec)
    out = _plan_entry_points(io)
    plan = fwd_plan(spec)
    if plan is not None:
        out.update(_one_call_entry_points(io, plan))
    if spec.target.backend == "llvm-cpu":
        out.update(_cpu_entry_points(io, out["step"]))
    out.update(_dense_entry_points(spec, io.t, io.seq, io.hq))
    return out


def _plan_entry_points(io: _Io) -> dict:
    """The host-driven tile plan's ``init`` / ``step`` / ``finalize``."""
    from .graph import DESC_COLUMNS

    spec, state = io.spec, io.state()
    # the step template takes bf16 typed as bf16 on GPUs, as its int16 bits on the CPU (as the torch graphs do)
    cpu = spec.target.backend == "llvm-cpu"
    st = io.t if cpu else spec.dtype
    step = {"args": {**io.qkv(st), "scale": [[1], "f32"], **state, "desc": [["P", len(DESC_COLUMNS)], "i32"]},
            "results": state, "desc_columns": list(DESC_COLUMNS)}
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
    from .kernels.ragged import PREFIX_SCALARS, RAGGED_SCALARS

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
                 "scalars as fmha_iree.frames.Frame.table() writes them (fmha_iree/kernels/ragged.py)"),
    }
    out.update(_tiles_entry_point(spec, plan, t, io.seq, hq))
    if spec.layout == "bshd" and not plan.pads:
        out.update(_gpu_packed_entry_points(io, frame_args))
    return out


def _gpu_packed_entry_points(io: _Io, frame_args: dict) -> dict:
    """``fwd_packed`` and its paged forms (``kernels.packed``)."""
    from .kernels.packed import PACKED_SCALARS

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
                                    "(fmha_iree/kernels/packed.py)"}
    return out


def _cpu_entry_points(io: _Io, step: dict) -> dict:
    """A CPU module's ``rows`` / ``rows_kpad``, ``units``, ``waves_varlen``, ``units_varlen``
    (bshd), ``step_open`` and (bshd) ``rows_packed`` / ``rows_packed_pages``."""
    from .mlir_templates.unit_varlen import TILE_COLUMNS
    from .rows import ROWS_DESC_COLUMNS

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
                 "(fmha_iree.plan.wave_tables; the tables' layout in mlir/unit_waves.mlir.in), rows of no slot "
                 "0 (lse -inf)"),
    }
    if spec.layout == "bshd":
        out["units_varlen"] = {
            "args": {"q": [[1, "Tq", hq, spec.dq], t], "k": [[1, "Tk", "Hk", spec.dq], t],
                     "v": [[1, "Tk", "Hk", spec.dv], t], "tiles": [["N", 8], "i64 host buffer"],
                     "scale": [[], "f32 scalar"]},
            "results": {"out": [[1, "Tq", hq, spec.dv], t], "lse": [[1, hq, "Tq"], "f32"]},
            "tile_columns": list(TILE_COLUMNS),
            "note": (f"group mode's packed sequences in one call: a table of {varlen_rows(spec.tiles)}-row tiles "
                     "(fmha_iree.plan.unit_tiles) looped inside the module, rows of no tile 0 (lse -inf)"),
        }
    out["step_open"] = {**step, "note": "step for units whose R rows all see the C keys of their "
                                        "chunk (no mask; fmha_iree.plan.Block.unmasked)"}
    if spec.layout == "bshd":
        out.update(_packed_entry_points(spec, t, hq))
    return out


def _tiles_entry_point(spec: KernelSpec, plan, t: str, seq, hq: str) -> dict:
    """``fwd_tiles`` where the module has it (``kernels.tiles``)."""
    from .kernels.tiles import STEP, TILE_COLUMNS, tiles_shape

    shape = tiles_shape(plan)
    if shape is None:
        return {}
    scratch = ["edge mask", "edge K", "edge V", "acc", "max", "sum", "tiles' out", "tiles' LSE"]
    out = {"fwd_tiles": {
        "args": {"q": [seq("?", spec.dq), t], "k": [seq("?", spec.dq), t], "v": [seq("?", spec.dv), t],
                 "idx": [["L"], "i32"], "scale": [[], "f32 scalar"], "N": [[], "i64 scalar"],
                 "NL": [[], "i64 scalar"], "RL": [[], "i64 scalar"], "E": [[], "i64 scalar"]},
        "results": {"out": [seq(hq, spec.dv), t], "lse": [["NL", hq, "RL"], "f32"],
                    "scratch": [scratch + (["tiles' Q"] if spec.group > 1 else []), "dropped by the caller"]},
        "rows": shape.rows, "edge_keys": shape.ew, "edge_parts": shape.parts, "key_step": STEP,
        "table_columns": list(TILE_COLUMNS),
        "note": (f"tiles of {shape.rows} query rows (G heads of a KV head as rows), each over its own keys: "
                 f"idx holds the table [N, {len(TILE_COLUMNS)}] longest first, then each out row's tile row (B * Sq) and each LSE "
                 "row's (NL * RL), -1 for rows no sequence owns (fmha_iree.key_tiles.tile_table); a tile's "
                 "rows all see keys [0, nk) of its sequence, some see [nk, nk + ne)"),
    }}
    if spec.layout == "bshd":
        e = out["fwd_tiles"]
        out["fwd_tiles_paged"] = {
            **e, "args": {**e["args"], "TK": [[], "i64 scalar"]},
            "results": {**e["results"], "scratch": [e["results"]["scratch"][0] + ["gathered K", "gathered V"],
                                                    "dropped by the caller"]},
            "note": ("fwd_tiles over a paged cache: k / v the cache's rows [1, pages * page, Hk, D], the table "
                     "ending with the cache row of each of the TK used keys in sequence order "
                     "(fmha_iree.key_tiles.paged_call), gathered first")}
    return out


def _dense_entry_points(spec: KernelSpec, t: str, seq, hq: str) -> dict:
    """The one-call entry points of ``entry_points``: compiled-in CPU row blocks, or the GPU
    templates (``dense``, ``causal`` and the per-length entries)."""
    out = {}
    dense = dense_params(spec)
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
        a, nb = dense["align"], dense["causal_blocks"]
        tiled = lambda h, d: ["?", h, f"S/{a}", a, d] if spec.layout == "bhsd" else ["?", f"S/{a}", a, h, d]  # noqa: E731
        tt = spec.dtype  # the templates take bf16 typed as bf16 (the torch entry points take i16 bits)
        io = {"q": [tiled(hq, spec.dq), tt], "k": [tiled("Hk", spec.dq), tt], "v": [tiled("Hk", spec.dv), tt]}
        res = {"out": [tiled(hq, spec.dv), tt], "lse": [["?", hq, f"S/{a}", a], "f32"]}
        # caller-owned storage for the intermediates; its size in bytes is what the exported
        # `<name>_transients_size` returns for the same arguments (mlir_templates.dense._dense_common)
        io_s = {**io, "scale": [[1], "f32"], "workspace": [["<name>_transients_size"], "hal.buffer"]}
        out["dense"] = {"args": io_s, "results": res,
                        "note": f"every row sees every key; Sq, Sk multiples of {a}"}
        out["causal"] = {"args": io_s, "results": res,
                         "note": f"row i sees keys j <= i; Sq == Sk, a multiple of {a * nb}"}
        for s, c in sorted(dense["seqlens"].items()):
            fix = lambda shp: [s // a if x == f"S/{a}" else x for x in shp]  # noqa: E731
            sio = {n: [fix(shp), ty] for n, (shp, ty) in io_s.items()}
            sres = {n: [fix(shp), ty] for n, (shp, ty) in res.items()}
            out[f"causal_s{s}"] = {"args": sio, "results": sres,
                                   "note": f"row i sees keys j <= i; Sq == Sk == {s} (tree of dense blocks, diagonal {c})"}
            out[f"dense_o_s{s}"] = {"args": sio, "results": {"out": sres["out"]},
                                    "note": f"every row sees every key, no lse (IREE's fused attention op); Sq == Sk == {s}"}
            if s in dense["causal_o"]:
                out[f"causal_o_s{s}"] = {"args": sio, "results": {"out": sres["out"]},
                                         "note": f"row i sees keys j <= i, no lse (fused attention op, masked); Sq == Sk == {s}"}
            if s in dense["window"]:
                wio = {n: v for n, v in sio.items() if n != "workspace"}
                wio.update({"win": [[1], "i32"], "workspace": sio["workspace"]})
                out[f"window_s{s}"] = {"args": wio, "results": sres,
                                       "note": f"row i sees keys i - win[0] <= j <= i, 0 <= win[0] <= {dense['window'][s]}; "
                                               f"Sq == Sk == {s} (diagonal and previous blocks of {dense['window'][s]})"}
    return out


def _packed_entry_points(spec: KernelSpec, t: str, hq: str) -> dict:
    """A bshd CPU module's ``rows_packed`` / ``rows_packed_pages`` (``mlir_templates.rows_packed``)."""
    from .mlir_templates.rows_packed import ROWS_PACKED_DESC_COLUMNS

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
