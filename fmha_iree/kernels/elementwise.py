"""Lowering of the elementwise dispatches around the attention ops (Q copy, normalize).

With dynamic sizes IREE 3.13 gives such an op one 128-element row per 32-thread workgroup (a
``[1, .., 1, 128]`` tile): the Q copy and the normalize of a B4 H16 S4096 call then moved 0.8-1.2
TB/s on the H200 (0.16 ms each, 2026-12-01, torch.profiler; the normalize 0.06 ms with 8 rows of
8 elements per thread). ``copy_attrs`` tiles rows of the op's innermost (static) dim per
workgroup; on the CPU (and where IREE chooses the attention lowering) it returns "" and IREE
keeps its own.
"""

from __future__ import annotations

__all__ = ["copy_attrs"]


def copy_attrs(lowering, *, rank: int, row_dim: int, inner: int, rows: int = 32, vec: int = 8,
               thread_rows: int = 4) -> str:
    """``attrs = {compilation_info = ...}`` text for a ``linalg.generic`` over ``rank`` parallel
    loops: ``inner`` iterations of the last loop (its size, or a tile of a size proven a multiple
    of it) and ``rows`` of loop ``row_dim`` per workgroup, ``thread_rows`` x ``vec`` elements per
    thread; "" when ``lowering`` is None or a CPU lowering."""
    if not lowering or isinstance(lowering, str) or lowering.get("backend") == "cpu":
        return ""
    if inner % vec:
        return ""
    sg = int(lowering.get("subgroup_size", 64))
    wg, th = [1] * rank, [1] * rank
    wg[row_dim], wg[-1], th[row_dim], th[-1] = rows, inner, thread_rows, vec
    threads = rows * inner // (vec * thread_rows)
    if threads % sg:
        return ""
    lst = lambda xs: "[" + ", ".join(str(x) for x in xs) + "]"  # noqa: E731
    return (f" attrs = {{compilation_info = #iree_codegen.compilation_info<"
            f"lowering_config = #iree_gpu.lowering_config<{{workgroup = {lst(wg)}, thread = {lst(th)}}}>, "
            f"translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> "
            f"workgroup_size = [{threads}, 1, 1] subgroup_size = {sg}>>}}")
