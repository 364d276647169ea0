"""The arguments of :func:`fmha_iree.integrations.distributed.context_parallel_attention`, checked on every rank
alike: each rank checks its own (:func:`check_local`), the ranks exchange what they found in one
``all_gather`` (:func:`gather_meta`) and every rank raises the same error when any rank refused its
arguments or the ranks disagree (:func:`check_meta`), so that no rank is left waiting in the ring.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from ..problem.operand import _TORCH_DTYPES, _check_torch_kind

__all__ = ["LAYOUTS", "group_info", "check_local", "gather_meta", "check_meta"]

LAYOUTS = ("bhsd", "bshd")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_META = ("batch", "q heads", "k/v heads", "shard length", "q/k head dim", "v head dim", "dtype", "layout",
         "causal", "scale")


def group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) of ``group``; ValueError naming ``group`` when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call torch.distributed.init_process_group "
                         "first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def _check_flags(causal, return_lse, layout):
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_tensors(q, k, v, layout: str) -> tuple[int, int, int, int, int, int]:
    """(B, Hq, Hk, S, Dq, Dv) of this rank's shards, or an error naming the argument."""
    for name, x in zip("qkv", (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES or x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}; q, k and v must share one of float16, bfloat16, float32")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {list(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
        _check_torch_kind(x, name)  # meta / sparse / nested tensors, inputs that want a gradient
    (B, Hq, S, Dq), (Bk, Hk, Sk, Dk), (Bv, Hv, Sv, Dv) = (_bhsd_shape(x, layout) for x in (q, k, v))
    if (Bk, Bv) != (B, B) or (Hv, Sv) != (Hk, Sk) or Dk != Dq:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} do not match q {list(q.shape)} ({layout}: "
                         "same batch, k/v same heads and length, k head dim = q head dim)")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hk})")
    if Sk != S:
        raise ValueError(f"k/v shards have {Sk} positions but q's has {S}: q, k and v share one sharded sequence")
    return B, Hq, Hk, S, Dq, Dv


def _check_runner(module, device, dtype: torch.dtype, heads: tuple[int, int, int, int]):
    """``module`` (a loaded module, which then runs every block) or ``device`` (``fmha_fwd``'s)."""
    from ..deploy import DeployedFmha
    from ..problem.targets import resolve_device

    if module is None:
        resolve_device(device)
        return
    if not isinstance(module, DeployedFmha):
        raise TypeError(f"module must be a loaded module (fmha_iree.load), got {type(module).__name__}")
    if device is not None:
        raise ValueError(f"device: a loaded module runs on its own device ({module.device_uri}); pass module or "
                         "device, not both")
    module.check_heads(_TORCH_DTYPES[str(dtype)], *heads)


def check_local(q, k, v, causal, scale, layout, return_lse, device, module) -> tuple[list[int], float]:
    """This rank's arguments: ([B, Hq, Hk, S, Dq, Dv, dtype, layout], scale), or an error naming the
    argument. Not yet checked against the other ranks."""
    from ..problem.spec import check_scale

    _check_flags(causal, return_lse, layout)
    B, Hq, Hk, S, Dq, Dv = _check_tensors(q, k, v, layout)
    _check_runner(module, device, q.dtype, (Hq, Hk, Dq, Dv))
    return [B, Hq, Hk, S, Dq, Dv, _DTYPES.index(q.dtype), LAYOUTS.index(layout)], check_scale(scale, Dq)


def _bhsd_shape(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    b, x1, x2, d = x.shape
    return (b, x1, x2, d) if layout == "bhsd" else (b, x2, x1, d)


def gather_meta(local, error: Exception | None, causal: bool, group, world: int, device) -> list[list[int]]:
    """Every rank's arguments (one ``all_gather`` of ``len(_META) + 1`` int64 each): the first
    entry is 1 where that rank refused its own arguments."""
    fields, scale = local if error is None else ([0] * 8, 0.0)
    bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    flag = int(causal) if error is None else 0
    row = torch.tensor([int(error is not None), *fields, flag, bits], dtype=torch.int64, device=device)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    return [r.tolist() for r in rows]


def _shown(what: str, value: int):
    """A gathered field as the caller wrote it (the int64 codes of dtype, layout, scale decoded)."""
    if what == "scale":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    if what == "dtype":
        return str(_DTYPES[value]).replace("torch.", "")
    return LAYOUTS[value] if what == "layout" else value


def check_meta(meta: list[list[int]], error: Exception | None) -> list[int]:
    """Raise (on every rank alike) unless all ranks agree; return every rank's shard length."""
    if error is not None:
        raise error
    bad = [r for r, m in enumerate(meta) if m[0]]
    if bad:
        raise ValueError(f"ranks {bad} of the group refused their arguments (their error says why)")
    for i, what in enumerate(_META):
        if what != "shard length" and len({m[i + 1] for m in meta}) > 1:
            raise ValueError(f"ranks disagree on {what}: {[_shown(what, m[i + 1]) for m in meta]} (rank order); "
                             "every rank must call with the same heads, head dims, dtype, layout, causal and scale")
    return [m[4] for m in meta]
