"""``rows_packed``: the CPU's short queries of packed (group-mode) sequences, template
``mlir/rows_packed.mlir.in``.

Signature (``Dq``, ``Dv``, ``G`` static; bf16 crosses as i16 bit patterns, as in the CPU's torch
graphs)::

    rows_packed(q [1, Tq, Hq, Dq], k [1, Tk, Hk, Dq], v [1, Tk, Hk, Dv], scale[1] f32,
                desc [n, 6] i32, mq: i64, mk: i64) -> (out [n, mq, Hq, Dv], lse [n, Hq, mq] f32)
    rows_packed_pages(q, k_cache [pages, P, Hk, Dq], v_cache [pages, P, Hk, Dv], scale, desc,
                      block_table [n, max_pages] i32, mq, mk) -> (out, lse)

``desc[b]`` = (q_start, qlen, k_start, klen, y, x): sequence ``b``'s rows and keys in the packed
tensors and CK's coordinates for its own lengths (row ``i`` sees key ``j`` iff ``i < qlen``,
``j < klen`` and ``i - y + 1 <= j < i + x``); ``mq`` / ``mk`` at least every qlen / klen, both
lengths >= 1. Rows past qlen are padding the caller drops. The keys are read where they lie (a
key index past klen reads the sequence's last key, its weight 0), so the call copies nothing the
size of K or V; ``rows`` / ``rows_kpad`` need the sequences gathered into a padded batch first
(on the dev CPU a B32 decode spent most of its call in those host gathers: docs/BENCHMARKS.md,
"CPU: the 2-core x86_64 development machine").
With ``paged=True`` (``rows_packed_pages``) key ``j`` of sequence ``b`` is row ``j % P`` of page
``block_table[b, j // P]`` (``paged.PagedCache``'s convention; desc's k_start unused), so a paged
cache is read in place too; the table's entries for pages past a sequence's keys are never read.
"""

from __future__ import annotations

from .lowering import _load
from .scores import softcap_lines

__all__ = ["render_rows_packed", "ROWS_PACKED_DESC_COLUMNS"]

from ...problem.abi import ROWS_PACKED_DESC_COLUMNS

# storage type at the ABI (bf16 as i16 bit patterns) per dtype
_STORAGE = {"f32": "f32", "f16": "f16", "bf16": "i16"}


def _to_f32(dtype: str) -> str:
    """Region lines turning the extracted ``%x`` (storage type) into ``%xf`` (f32)."""
    if dtype == "f32":
        return "    %xf = arith.addf %x, %zero : f32"
    if dtype == "f16":
        return "    %xf = arith.extf %x : f16 to f32"
    return "    %xb = arith.bitcast %x : i16 to bf16\n    %xf = arith.extf %xb : bf16 to f32"


def _from_f32(dtype: str) -> str:
    """Region lines yielding ``%y`` (f32) in the storage type."""
    if dtype == "f32":
        return "    linalg.yield %y : f32"
    if dtype == "f16":
        return "    %yt = arith.truncf %y : f32 to f16\n    linalg.yield %yt : f16"
    return "    %yb = arith.truncf %y : f32 to bf16\n    %yi = arith.bitcast %yb : bf16 to i16\n    linalg.yield %yi : i16"


def _scores_config(dist: tuple[int, int], vec: int) -> str:
    """The scores op's CPU lowering: workgroups of ``dist`` (rows, keys), the head dim reduced in
    vectors of ``vec`` (contiguous loads of each key row)."""
    return ("compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [{dist[0]}, {dist[1]}, 0], vector_common_parallel = [1, 1, 0], "
            f"vector_reduction = [0, 0, {vec}]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>, ")


def _pv_config(group: int, dv: int, vec: int) -> str:
    """The P V op's CPU lowering: up to 4 of one KV head's ``group`` rows by ``vec`` of Dv per
    vector tile (each V row loaded once for them), keys one at a time."""
    g = _divisor(group, 4)
    return ("compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [1, {PV_ROWS}, {group}, {dv}, 0], vector_common_parallel = [1, 1, {g}, {vec}, 0], "
            "vector_reduction = [0, 0, 0, 0, 1]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>, ")


def _divisor(n: int, most: int) -> int:
    """The largest power of two up to ``most`` dividing ``n``."""
    d = 1
    while d * 2 <= most and n % (d * 2) == 0:
        d *= 2
    return d


# Tiles of the two ops that read K / V, chosen on the dev CPU (f32 D64 Hq32 Hk8, a 32-sequence
# decode): IREE's own configs vectorized the scores across keys (a gather of K rows) and walked all
# keys once per 8 columns of Dv in P V; these read each key row whole, measured faster. The scores
# reduce the head dim in one vector of up to SCORES_VEC (one horizontal sum per score), faster than
# vectors of 16. The vector dims are fixed by MLIR's tensor.extract vectorizer: a read is
# contiguous only along the op's trailing loop dim, which IREE makes the reduction (keys in P V), so
# P V's V rows are gathered element by element; P V's vector tile spans up to PV_VEC columns of Dv
# (each key's row index computed once for them), faster at 64 than at 32 or 16, or with two or
# four keys per vector step (docs/tried.md, "`rows_packed`'s P V with contiguous reads of V").
SCORES_TILES = (8, 256)
SCORES_VEC = 64
PV_VEC = 64
PV_ROWS = 16


# Where key j (clamped to the sequence's last, %jc) of sequence %b lies: the packed tensors' row
# k_start + j, or row j % P of page block_table[b, j // P] (P: the cache's page size).
_PACKED_KEY = ("    %ks32 = tensor.extract %desc[%b, %c2] : tensor<?x6xi32>\n"
               "    %ks = arith.index_cast %ks32 : i32 to index\n"
               "    %kr = arith.addi %ks, %jc : index", "%c0, %kr")
_PAGED_KEY = ("    %kpi = arith.divui %jc, %psz : index\n"
              "    %kin = arith.remui %jc, %psz : index\n"
              "    %kpg32 = tensor.extract %bt[%b, %kpi] : tensor<?x?xi32>\n"
              "    %kpg = arith.index_cast %kpg32 : i32 to index", "%kpg, %kin")


def render_rows_packed(*, func_name: str, dtype: str, group: int, dq: int, dv: int, paged: bool = False,
                       scores_tiles: tuple[int, int] = SCORES_TILES, vec: int = SCORES_VEC, pv_vec: int = PV_VEC,
                       softcap: float = 0.0) -> str:
    """MLIR text of ``util.func public @func_name`` (the module docstring's signatures: ``paged``
    for ``rows_packed_pages``); ``softcap``: the module's logits soft-cap on the log2-unit scores
    (``scores``), applied where the mask is."""
    capped = softcap_lines("%x", softcap)
    if dtype not in _STORAGE:
        raise ValueError(f"dtype: expected one of {sorted(_STORAGE)}, got {dtype!r}")
    key_row, key_at = _PAGED_KEY if paged else _PACKED_KEY
    table_setup = f"  %psz = tensor.dim %k, %c1 : tensor<?x?x?x{int(dq)}x{_STORAGE[dtype]}>\n" if paged else ""
    return _load("rows_packed.mlir.in").substitute(
        key_row=key_row, key_at=key_at, table_setup=table_setup,
        softcap="".join(line + "\n" for line in capped), score="%capped" if capped else "%x",
        table_arg=" %bt: tensor<?x?xi32>," if paged else "",
        key_doc="pages through the block table" if paged else "each sequence from its start",
        func_name=func_name, G=int(group), DQ=int(dq), DV=int(dv), ST=_STORAGE[dtype],
        scores_config=_scores_config(scores_tiles, _divisor(int(dq), vec)) if scores_tiles else "",
        pv_config=_pv_config(int(group), int(dv), _divisor(int(dv), pv_vec)) if pv_vec else "",
        to_f32=_to_f32(dtype), out_from_f32=_from_f32(dtype))
