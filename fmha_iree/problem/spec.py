"""Problem specification: validate a call, and the kernel specialization it needs.

Everything here runs before anything is compiled or launched; bad input raises ``ValueError`` or
``TypeError`` naming the argument. Only numpy is needed (torch tensors are recognised by duck
typing), so deployed modules can validate without torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .alibi import checked_alibi
from .bias import checked_bias, refuse_both
from .mask import Mask, as_mask
from .operand import Operand, _is_torch, as_operand
from .targets import Target
from .tiles import TileConfig, check_tiles_for, default_tiles

__all__ = ["KernelSpec", "BatchProblem", "check_batch", "MAX_HEAD_DIM"]

LAYOUTS = ("bhsd", "bshd")
MAX_HEAD_DIM = 256
# the GPU kernels index rows (every axis but the head dim, multiplied out) as 32-bit values, with
# room for a tile's rounding (kernels.ir.Fn.bounded); a tensor past it would not fit one GPU anyway
ROWS_MAX = 2**31 - 2**16
_F32_MAX = float(np.finfo(np.float32).max)  # kernels compute in float32: a larger scale is inf there


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything a compiled module is specialized on (the compile key, with the toolchain).

    Batch size, sequence lengths, head counts (at a fixed ratio), masks, scale and the number of
    work units are runtime values: changing them never compiles again. ``seqlens`` optionally
    adds entry points specialized on those lengths (Sq == Sk == S): on GPUs causal as a tree of
    dense blocks and out-only fused ops (``mlir_templates``), on the CPU row blocks of plain
    matmul/softmax (``rows.RowBlocks``), which ``batch`` / ``kv_heads`` (0: any) also fix:
    IREE's CPU code for them with a dynamic batch dim was several times slower (docs/BENCHMARKS.md,
    "CPU: the 2-core x86_64 development machine"). Other shapes still run.
    """

    dtype: str  # f16, bf16, f32
    layout: str  # bhsd, bshd
    group: int  # Hq // Hk
    dq: int
    dv: int
    tiles: TileConfig
    target: Target
    seqlens: tuple = ()
    batch: int = 0
    kv_heads: int = 0
    softcap: float = 0.0  # logits soft-cap ``cap * tanh(s / cap)`` in every score stage; 0: none
    # ALiBi: the slopes an argument of ``fwd_tiles``, the module's only path (with its paged form),
    # built in the GPU formulation on every target (``codegen.source.fused``)
    alibi: bool = False
    # an elementwise bias (``problem.bias``): an argument of ``fwd_tiles``, as ALiBi's slopes
    bias: bool = False

    def __post_init__(self):
        if self.alibi and self.bias:
            raise ValueError("alibi_slopes and bias: a module takes one of them (as CK's bias_enum)")

    @property
    def tiles_only(self) -> bool:
        """Whether ``fwd_tiles`` (with its paged and short forms) is the module's only path: ALiBi
        and elementwise-bias modules, built in the GPU formulation on every target."""
        return self.alibi or self.bias

    @property
    def module_name(self) -> str:
        t = self.tiles
        s = ("_s" + "_".join(map(str, self.seqlens))) if self.seqlens else ""
        s += f"_b{self.batch}" if self.batch else ""
        s += f"_h{self.kv_heads}" if self.kv_heads else ""
        s += f"_cap{self.softcap:.9g}".replace(".", "p") if self.softcap else ""
        s += "_alibi" if self.alibi else ""
        s += "_bias" if self.bias else ""
        return (
            f"fmha_{self.dtype}_{self.layout}_g{self.group}_d{self.dq}x{self.dv}"
            f"_t{t.ck_name}c{t.kv_chunk}_{self.target.arch}{s}"
        )

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype, "layout": self.layout, "group": self.group, "dq": self.dq,
            "dv": self.dv, "tiles": self.tiles.as_dict(), "target": dataclasses.asdict(self.target),
            "seqlens": list(self.seqlens), "batch": self.batch, "kv_heads": self.kv_heads,
            **({"softcap": self.softcap} if self.softcap else {}),
            **({"alibi": True} if self.alibi else {}),
            **({"bias": True} if self.bias else {}),
        }


def _operands(q, k, v, ndim: int, what: str) -> tuple[Operand, Operand, Operand]:
    """Convert q, k, v; all of one dtype and ``ndim`` dimensions."""
    ops = as_operand(q, "q"), as_operand(k, "k"), as_operand(v, "v")
    for name, o in zip("kv", ops[1:]):
        if o.dtype != ops[0].dtype:
            raise TypeError(f"{name} has dtype {o.dtype} but q has {ops[0].dtype}: all inputs must share one dtype")
        if o.on_device != ops[0].on_device or (o.on_device and o.array.device_uri != ops[0].array.device_uri):
            raise TypeError(f"{name} and q must both be DeviceTensors on one device, or both host arrays")
    for name, o in zip("qkv", ops):
        if o.array.ndim != ndim:
            raise ValueError(f"{name} must be {what}, got shape {list(o.array.shape)}")
        rows = math.prod(o.array.shape[:-1])
        if rows > ROWS_MAX:
            raise ValueError(f"{name} has {rows} rows (its shape {list(o.array.shape)} without the head dim, "
                             f"multiplied out): at most {ROWS_MAX} are supported")
    return ops


def _check_kv(hq: int, dq: int, k_hsd, v_hsd, seq_name: str):
    """k/v agree with q and each other: head dims, heads (GQA ratio), sequence lengths."""
    (hk, sk, dk), (hv, sv, dv) = k_hsd, v_hsd
    if dk != dq:
        raise ValueError(f"k head dim {dk} must equal q head dim {dq}")
    if hv != hk or sv != sk:
        raise ValueError(f"v (heads {hv}, {seq_name} {sv}) must match k (heads {hk}, {seq_name} {sk})")
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hk})")
    check_head_dims(dq, dv)


def check_scale(scale, dq: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dq)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or abs(scale) > _F32_MAX:
        raise ValueError(f"scale must be finite in float32 (|scale| <= {_F32_MAX:.4g}), got {scale}")
    return scale


def check_softcap(softcap) -> float:
    """The logits soft-cap as a float (0.0 for None): ``s = softcap * tanh(s / softcap)``."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive real number or None, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and 0.0 < softcap <= _F32_MAX):
        raise ValueError(f"softcap must be positive and finite in float32, got {softcap}")
    return softcap


def check_tiles(tiles, target: Target, dq: int, dv: int, dtype: str) -> TileConfig:
    """The tile config to use: ``tiles`` if it can work on ``target`` (else ``ValueError`` with the
    reasons), or the target's default."""
    if tiles is None:
        tiles = default_tiles(target.family, dq, dv, target.arch, dtype)
    elif not isinstance(tiles, TileConfig):
        raise TypeError(f"tiles must be a fmha_iree.TileConfig or None, got {type(tiles).__name__}")
    return check_tiles_for(tiles, target.family, target.arch, dq, dv, dtype)


def check_head_dims(dq: int, dv: int):
    for name, d in (("q/k head dim", dq), ("v head dim", dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} {d} is not supported (1..{MAX_HEAD_DIM})")


def check_seqlens(cu, name: str, batch: int, limit: int) -> np.ndarray:
    """Validate a ``[B+1]`` cumulative int array; return the per-batch lengths."""
    cu = int_vector(cu, name, batch + 1)
    if (cu < 0).any():
        raise ValueError(f"{name} must be non-negative")
    lens = np.diff(cu)
    if (lens < 0).any():
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if (lens > limit).any():
        b = int(np.argmax(lens > limit))
        raise ValueError(f"{name} gives batch {b} {int(lens[b])} rows, past the tensor's {limit}")
    return lens


@dataclasses.dataclass
class BatchProblem:
    """A validated batch-mode call."""

    q: Operand
    k: Operand
    v: Operand
    layout: str
    batch: int
    hq: int
    hk: int
    sq: int
    sk: int
    dq: int
    dv: int
    mask: Mask
    scale: float
    q_lens: np.ndarray  # effective rows per batch
    k_lens: np.ndarray  # effective keys per batch
    softcap: float = 0.0  # the logits soft-cap, 0 for none (a module's constant: KernelSpec.softcap)
    alibi: np.ndarray | None = None  # ALiBi slopes float32 [1 or B, Hq] (problem.alibi), None for none
    bias: object = None  # an elementwise bias as the kernels read it (problem.bias.KernelBias), None for none

    def kernel(self, tiles: TileConfig, target: Target) -> KernelSpec:
        return KernelSpec(self.q.dtype, self.layout, self.hq // self.hk, self.dq, self.dv, tiles, target,
                          softcap=self.softcap, alibi=self.alibi is not None, bias=self.bias is not None)


def window_mask(mask) -> Mask:
    """``as_mask(mask)`` for the paths, which apply windows only: sink tokens are added to their
    results by the public calls (``paths.sink_tokens``), and refused here."""
    mask = as_mask(mask)
    if mask.sink:
        raise ValueError(f"mask {mask}: sink tokens are added by fmha_fwd, fmha_fwd_varlen, DeployedFmha and the "
                         "torch ops' attention wrappers; this call takes a window without them")
    return mask


def check_batch(q, k, v, *, mask, scale, layout, cu_seqlen_q, cu_seqlen_k, softcap=None,
                alibi_slopes=None, bias=None) -> BatchProblem:
    """Validate a batch-mode ``fmha_fwd`` call (see :func:`fmha_iree.fmha_fwd`)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    layout = str(layout)  # a str subclass (numpy.str_) would reach the torch graph as a numpy value
    mask = window_mask(mask)
    refuse_both(alibi_slopes, bias)
    qo, ko, vo = _operands(q, k, v, 4, f"4-D ({layout})")

    def bhsd(a):
        b, x1, x2, d = a.shape
        return (b, x1, x2, d) if layout == "bhsd" else (b, x2, x1, d)

    B, Hq, Sq, Dq = bhsd(qo.array)
    Bk, Hk, Sk, Dk = bhsd(ko.array)
    Bv, Hv, Sv, Dv = bhsd(vo.array)
    if Bk != B or Bv != B:
        raise ValueError(f"batch sizes differ: q {B}, k {Bk}, v {Bv}")
    _check_kv(Hq, Dq, (Hk, Sk, Dk), (Hv, Sv, Dv), "seqlen")
    scale, softcap = check_scale(scale, Dq), check_softcap(softcap)
    q_lens = np.full(B, Sq, np.int64) if cu_seqlen_q is None else check_seqlens(cu_seqlen_q, "cu_seqlen_q", B, Sq)
    k_lens = np.full(B, Sk, np.int64) if cu_seqlen_k is None else check_seqlens(cu_seqlen_k, "cu_seqlen_k", B, Sk)
    return BatchProblem(qo, ko, vo, layout, B, Hq, Hk, Sq, Sk, Dq, Dv, mask, scale, q_lens, k_lens, softcap,
                        checked_alibi(alibi_slopes, B, Hq, Hk),
                        checked_bias(bias, qo, batch=B, hq=Hq, hk=Hk, sq=Sq, sk=Sk))


def int_array(x, name: str, shape_doc: str = "") -> np.ndarray:
    """An int64 copy of an int array (any int dtype; torch tensors and lists accepted)."""
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    elif isinstance(x, (list, tuple)):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an int32 tensor/array{shape_doc}, got {type(x).__name__}")
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got {x.dtype}")
    return x.astype(np.int64)


def int_vector(x, name: str, length: int | None) -> np.ndarray:
    """An int64 copy of a 1-D int array of shape [length] (any int dtype; torch tensors and lists
    accepted)."""
    x = int_array(x, name)
    if x.ndim != 1 or (length is not None and x.shape[0] != length):
        want = "[B+1]" if length is None else f"[{length}]"
        raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")
    return x.astype(np.int64)


def _check_starts(s: np.ndarray, name: str, total: int):
    if s.shape[0] < 1 or s[0] != 0:
        raise ValueError(f"{name} must start at 0, got {s[:1].tolist()}")
    if (np.diff(s) < 0).any():
        raise ValueError(f"{name} must be non-decreasing, got {s.tolist()}")
    if s[-1] > total:
        raise ValueError(f"{name} ends at {int(s[-1])}, past the packed tensor's {total} tokens")


def _check_padded(p, name: str, lens: np.ndarray, total: int) -> np.ndarray:
    p = int_vector(p, name, len(lens) + 1)
    starts = p[:-1]
    if (starts < 0).any():
        raise ValueError(f"{name} must be non-negative")
    ends = starts + lens
    if (ends > total).any():
        b = int(np.argmax(ends > total))
        raise ValueError(f"{name}: sequence {b} ends at {int(ends[b])}, past the packed tensor's {total} tokens")
    order = np.argsort(starts, kind="stable")
    if (starts[order][1:] < ends[order][:-1]).any():
        raise ValueError(f"{name}: padded sequences overlap")
    return starts


def check_varlen(q, k, v, seqstart_q, seqstart_k, *, seqlen_k, seqstart_padded_q, seqstart_padded_k, mask, scale,
                 softcap=None, alibi_slopes=None, bias=None, k_len_override=None):
    """Validate a group-mode call; returns the problem (as a B=1 ``bshd`` batch over the packed
    token axis) and the per-sequence starts and lengths. ``k_len_override``: the sequences' keys where
    they are not the starts' (a paged cache's lengths, for the bias's check)."""
    mask = window_mask(mask)
    refuse_both(alibi_slopes, bias)
    qo, ko, vo = _operands(q, k, v, 3, "3-D [tokens, heads, head_dim]")
    Tq, Hq, Dq = qo.array.shape
    Tk, Hk, Dk = ko.array.shape
    Tv, Hv, Dv = vo.array.shape
    _check_kv(Hq, Dq, (Hk, Tk, Dk), (Hv, Tv, Dv), "tokens")
    scale, softcap = check_scale(scale, Dq), check_softcap(softcap)

    sq = int_vector(seqstart_q, "seqstart_q", None)
    sk = int_vector(seqstart_k, "seqstart_k", None)
    if sk.shape != sq.shape:
        raise ValueError(f"seqstart_k has {sk.shape[0]} entries but seqstart_q has {sq.shape[0]}: both are [B+1]")
    _check_starts(sq, "seqstart_q", Tq if seqstart_padded_q is None else np.iinfo(np.int64).max)
    _check_starts(sk, "seqstart_k", Tk if seqstart_padded_k is None else np.iinfo(np.int64).max)
    q_len, k_have = np.diff(sq), np.diff(sk)
    k_len = k_have
    if seqlen_k is not None:
        k_len = int_vector(seqlen_k, "seqlen_k", len(q_len))
        if (k_len < 0).any() or (k_len > k_have).any():
            b = int(np.argmax((k_len < 0) | (k_len > k_have)))
            raise ValueError(f"seqlen_k[{b}] = {int(k_len[b])} is outside [0, {int(k_have[b])}] (the keys sequence {b} has)")
    q_start = sq[:-1] if seqstart_padded_q is None else _check_padded(seqstart_padded_q, "seqstart_padded_q", q_len, Tq)
    k_start = sk[:-1] if seqstart_padded_k is None else _check_padded(seqstart_padded_k, "seqstart_padded_k", k_have, Tk)

    def packed(o: Operand) -> Operand:
        return Operand(o.array.reshape((1,) + o.array.shape), o.dtype, o.is_torch)

    keys = k_len if k_len_override is None else k_len_override
    kb = checked_bias(bias, qo, batch=len(q_len), hq=Hq, hk=Hk, sq=int(q_len.max(initial=0)),
                      sk=int(np.max(keys, initial=0)), padded=True)
    problem = BatchProblem(packed(qo), packed(ko), packed(vo), "bshd", 1, Hq, Hk, Tq, Tk, Dq, Dv, mask, scale, q_len, k_len,
                           softcap, checked_alibi(alibi_slopes, len(q_len), Hq, Hk), kb)
    return problem, (q_start, q_len, k_start, k_len, sq[:-1], int(sq[-1]))
