"""Lowering of the elementwise dispatches around the attention ops (Q copy, gathers, masks,
normalize).

With dynamic sizes IREE 3.13 gives such an op one 128-element row per 32-thread workgroup
(a ``[1, .., 1, 128]`` tile), well below a copy's rate on the H200 (docs/BENCHMARKS.md, "How the
constants were chosen": ``fwd`` copy tiles). ``copy_attrs`` tiles rows of the op's innermost
(static) dim per workgroup; ``block_attrs`` gives a generator (the edge masks) one static block per
workgroup and 16 consecutive elements per thread. On the CPU (and where IREE chooses the attention
lowering) both return "" and IREE keeps its own.

IREE 3.13 proves no binding of these dispatches aligned beyond its element size, so NVPTX splits a
thread's vector of f16 into 2-byte accesses. Copies therefore move 64-bit words (``as_words`` /
``from_words``: the same buffers seen as i64 along the head dim): the Q copy, the edge masks (in
blocks) and the group-mode prefill measured faster on the H200 (docs/BENCHMARKS.md, "Copies as
64-bit words, edge masks in blocks").
"""

from __future__ import annotations

import dataclasses

from .ir import tensor_type

__all__ = ["copy_attrs", "block_attrs", "WORD", "word_elems", "as_words", "from_words", "Words"]

WORD = "i64"  # copies move 64-bit words
_BITS = {"f16": 16, "bf16": 16, "f32": 32}


def word_elems(dtype: str, *dims: int) -> int:
    """Elements of ``dtype`` per 64-bit word where each of ``dims`` (head dims) is a whole number
    of words, else 0. A copy over words reads and writes 8 bytes per element: IREE 3.13 cannot
    prove a dynamically offset binding aligned beyond its element size, so NVPTX splits a vector of
    f16 into 2-byte accesses (the Q copy ran well below a copy's rate on the H200: docs/BENCHMARKS.md,
    "Any batch-mode problem in one call: `fwd`")."""
    n = 64 // _BITS.get(dtype, 64)
    return n if n > 1 and all(d % n == 0 for d in dims) else 0


def as_words(fn, value: str, ty_shape: list, dyn: list[str], dtype: str, word: str = WORD) -> tuple[str, str]:
    """``value`` (a tensor of ``ty_shape``, last dim static, dynamic sizes ``dyn``) as ``word``
    integers along its last dim (``flow.tensor.bitcast``: the same buffer). Returns (value, type)."""
    src, dst = tensor_type(ty_shape, dtype), _word_type(ty_shape, dtype, word)
    sizes = ", ".join(dyn)
    return fn.let(f"flow.tensor.bitcast {value} : {src}{{{sizes}}} -> {dst}{{{sizes}}}", "w"), dst


def from_words(fn, value: str, ty_shape: list, dyn: list[str], dtype: str, word: str = WORD) -> str:
    """The inverse of ``as_words``: ``value`` (words) as the ``dtype`` tensor of ``ty_shape``."""
    src, dst = _word_type(ty_shape, dtype, word), tensor_type(ty_shape, dtype)
    sizes = ", ".join(dyn)
    return fn.let(f"flow.tensor.bitcast {value} : {src}{{{sizes}}} -> {dst}{{{sizes}}}", "w")


@dataclasses.dataclass(frozen=True)
class Words:
    """A copy of rank-4 ``dtype`` tensors from head dim ``d_src`` to ``d`` (zeros past ``d_src``),
    moved as 64-bit words where both head dims are whole words (``word_elems``), else as
    elements: ``source`` / ``result`` convert its input and output, ``elt`` / ``dw`` / ``dw_src``
    are the element type and head dims its op sees, ``vec`` its elements per thread
    (``copy_attrs``), ``zero`` the literal of a zero element."""

    dtype: str
    d: int
    d_src: int

    @property
    def n(self) -> int:
        """Elements per word (0: moved as elements)."""
        return word_elems(self.dtype, self.d, self.d_src)

    @property
    def elt(self) -> str:
        return WORD if self.n else self.dtype

    @property
    def dw(self) -> int:
        return self.d // self.n if self.n else self.d

    @property
    def dw_src(self) -> int:
        return self.d_src // self.n if self.n else self.d_src

    @property
    def vec(self) -> int:
        return 2 if self.n else 8

    @property
    def zero(self) -> str:
        return "0" if self.n else "0.0"

    def source(self, fn, value: str, dyn: list[str] | None = None, tag: str = "wd") -> tuple[str, str]:
        """(value, type) of the copy's input ``value`` (head dim ``d_src``) as its op reads it;
        ``dyn`` its three dynamic sizes (None: read from it with ``tensor.dim``, named ``tag``)."""
        ty = tensor_type(["?", "?", "?", self.d_src], self.dtype)
        if not self.n:
            return value, ty
        if dyn is None:
            dyn = [fn.let(f"tensor.dim {value}, {fn.c(i)} : {ty}", tag) for i in range(3)]
        return as_words(fn, value, ["?", "?", "?", self.d_src], dyn, self.dtype)

    def result(self, fn, value: str, dyn: list[str]) -> str:
        """The op's result ``value`` (dynamic sizes ``dyn``) as ``dtype`` elements of head dim ``d``."""
        return from_words(fn, value, ["?", "?", "?", self.d], dyn, self.dtype) if self.n else value


def _word_type(ty_shape: list, dtype: str, word: str) -> str:
    n = int(word[1:]) // _BITS[dtype]
    if n < 1 or int(ty_shape[-1]) % n:
        raise ValueError(f"{ty_shape} of {dtype} is not a whole number of {word} words")
    return tensor_type([*ty_shape[:-1], int(ty_shape[-1]) // n], word)


def _compilation_info(wg: list[int], th: list[int], threads: int, sg: int) -> str:
    lst = lambda xs: "[" + ", ".join(str(x) for x in xs) + "]"  # noqa: E731
    return (f" attrs = {{compilation_info = #iree_codegen.compilation_info<"
            f"lowering_config = #iree_gpu.lowering_config<{{workgroup = {lst(wg)}, thread = {lst(th)}}}>, "
            f"translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> "
            f"workgroup_size = [{threads}, 1, 1] subgroup_size = {sg}>>}}")


def _gpu(lowering) -> bool:
    return bool(lowering) and not isinstance(lowering, str) and lowering.get("backend") != "cpu"


def block_attrs(lowering, *, rank: int, block: tuple[int, ...], vec: int) -> str:
    """``attrs`` for a generator over ``rank`` parallel loops whose last ``len(block)`` loops are
    tiled by ``block`` (e.g. a mask's 16 rows, one 64-key column, 64 keys): one block per
    workgroup, ``vec`` consecutive elements of the last loop per thread, so each thread derives
    its indices once per ``vec`` elements (IREE 3.13's own config: one element per thread and
    step, with 64-bit divisions for each). "" off the GPU."""
    if not _gpu(lowering) or block[-1] % vec:
        return ""
    sg = int(lowering.get("subgroup_size", 64))
    threads = 1
    for b in block:
        threads *= b
    threads //= vec
    if threads % sg:
        return ""
    lead = [1] * (rank - len(block))
    return _compilation_info(lead + list(block), [1] * (rank - 1) + [vec], threads, sg)


def copy_attrs(lowering, *, rank: int, row_dim: int, inner: int, rows: int = 32, vec: int = 8,
               thread_rows: int = 4) -> str:
    """``attrs = {compilation_info = ...}`` text for a ``linalg.generic`` over ``rank`` parallel
    loops: ``inner`` iterations of the last loop (its size, or a tile of a size proven a multiple
    of it) and ``rows`` of loop ``row_dim`` per workgroup, ``thread_rows`` x ``vec`` elements per
    thread; "" when ``lowering`` is None or a CPU lowering."""
    if not _gpu(lowering) or inner % vec:
        return ""
    sg = int(lowering.get("subgroup_size", 64))
    wg, th = [1] * rank, [1] * rank
    wg[row_dim], wg[-1], th[row_dim], th[-1] = rows, inner, thread_rows, vec
    threads = rows * inner // (vec * thread_rows)
    if threads % sg:
        return ""
    return _compilation_info(wg, th, threads, sg)
