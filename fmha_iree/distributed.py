"""Context-parallel (ring) attention over ``torch.distributed``: every rank of a process group
holds one shard of the sequence of q, k and v; the K/V shards travel around the ring of ranks, and
each rank attends its own queries to every visiting shard with :func:`fmha_iree.fmha_fwd`, merging
the partial results through their log-sum-exp (float32).

Sequence layout (load-balanced, as torch's ``context_parallel`` and Megatron-LM): the global
sequence of length ``S`` is cut into ``2N`` chunks (``N`` ranks) with ``torch.tensor_split``
semantics, i.e. the first ``S % 2N`` chunks hold ``S // 2N + 1`` positions and the others
``S // 2N``; rank ``r`` holds chunks ``r`` and ``2N-1-r``, concatenated in that order.
:func:`shard_sequence` makes a rank's shard, :func:`unshard_sequence` puts all shards back together
and :func:`gather_sequence` does that across the group. Under a causal mask every rank then has
the same amount of work at every ring step; unmasked attention uses the same layout (it does not
depend on positions, so any layout would give the same result; one convention keeps shards
interchangeable between the two).

Devices: today :func:`fmha_iree.fmha_fwd` reads torch tensors through host memory, so each block
computed here copies its query rows and K/V to the host and its result back to ``q``'s device. The
ring itself moves ``q``'s tensors (CPU with ``gloo``, CUDA with ``nccl``). Once ``fmha_fwd`` takes
CUDA tensors in place, the blocks will stay on the GPU; nothing else here needs to change.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .spec import _check_torch_kind

__all__ = ["Block", "chunk_bounds", "shard_lengths", "shard_sequence", "unshard_sequence", "gather_sequence",
           "ring_blocks", "merge_attention", "context_parallel_attention"]

_LAYOUTS = ("bhsd", "bshd")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Block(NamedTuple):
    """One ``fmha_fwd`` call of a ring step: local query rows ``q0:q1`` against rows ``k0:k1`` of
    the visiting K/V shard, under ``mask`` (None: unmasked, ``"t"``: causal top-left)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: str | None


def _check_world(rank: int, world: int):
    for name, x in (("rank", rank), ("world", world)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")


def chunk_bounds(seqlen: int, world: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the ``2 * world`` chunks of a sequence of ``seqlen`` positions, as
    ``torch.tensor_split(x, 2 * world)`` cuts it: the first ``seqlen % (2 * world)`` chunks are one
    position longer than the others (some chunks are empty when ``seqlen < 2 * world``)."""
    _check_world(0, world)
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 0:
        raise ValueError(f"seqlen must be an int >= 0, got {seqlen!r}")
    base, extra = divmod(seqlen, 2 * world)
    bounds, start = [], 0
    for c in range(2 * world):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_lengths(seqlen: int, world: int) -> list[tuple[int, int]]:
    """Per rank ``r``, the lengths of its two chunks ``(len(chunk r), len(chunk 2N-1-r))``."""
    b = chunk_bounds(seqlen, world)
    n = 2 * world
    return [(b[r][1] - b[r][0], b[n - 1 - r][1] - b[n - 1 - r][0]) for r in range(world)]


def _seq_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for {name} of shape {list(x.shape)}, "
                         f"got {dim!r}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` (the whole sequence along ``dim``; 2 is ``bhsd``'s sequence
    axis, 1 ``bshd``'s): chunks ``rank`` and ``2*world-1-rank`` of :func:`chunk_bounds`,
    concatenated (a new tensor)."""
    _check_world(rank, world)
    dim = _seq_dim(x, dim, "x")
    b = chunk_bounds(x.shape[dim], world)
    (a0, a1), (c0, c1) = b[rank], b[2 * world - 1 - rank]
    return torch.cat([x.narrow(dim, a0, a1 - a0), x.narrow(dim, c0, c1 - c0)], dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` from rank ``r``, as
    :func:`shard_sequence` makes them): the inverse of sharding along ``dim``. The global length is
    the sum of the shards' lengths; a shard of another length than its rank's is a ValueError."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards:
        raise TypeError("shards must be a non-empty sequence of torch.Tensors, one per rank")
    dims = [_seq_dim(s, dim, f"shards[{r}]") for r, s in enumerate(shards)]
    world, dim = len(shards), dims[0]
    lengths = shard_lengths(sum(s.shape[dim] for s in shards), world)
    pieces: list = [None] * (2 * world)
    for r, s in enumerate(shards):
        if s.shape[dim] != sum(lengths[r]):
            raise ValueError(f"shards[{r}] has {s.shape[dim]} positions along dim {dim}; the layout of "
                             f"{world} ranks gives shard lengths {[sum(x) for x in lengths]}")
        pieces[r], pieces[2 * world - 1 - r] = torch.split(s, list(lengths[r]), dim)
    return torch.cat(pieces, dim)


def gather_sequence(x: torch.Tensor, *, group: dist.ProcessGroup | None = None, dim: int = 2) -> torch.Tensor:
    """Every rank's shard of ``x`` gathered into the whole sequence, on every rank of ``group``
    (a collective: two ``all_gather`` calls, the shard lengths then the zero-padded shards)."""
    dim = _seq_dim(x, dim, "x")
    world, _ = _group_info(group)
    n = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    lens = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    sizes = [int(t.item()) for t in lens]
    pad = list(x.shape)
    pad[dim] = max(sizes) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return unshard_sequence([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def ring_blocks(rank: int, src: int, lengths: Sequence[tuple[int, int]], causal: bool) -> list[Block]:
    """The calls rank ``rank`` makes against the K/V shard of rank ``src`` (``lengths``: every
    rank's two chunk lengths, :func:`shard_lengths`). Per chunk pair, query chunk ``qc`` against key
    chunk ``kc``: ``kc < qc`` unmasked, ``kc == qc`` causal, ``kc > qc`` not computed. With rank
    ``r`` holding chunks ``(r, 2N-1-r)`` the pairs group into one call per step: ``src == rank``
    the whole shard against itself, causal top-left (its positions increase along the shard);
    ``src < rank`` every query row against ``src``'s first chunk; ``src > rank`` the query rows of
    the second chunk against ``src``'s whole shard. Unmasked: everything against everything.
    Blocks with no query row or no key are left out."""
    (qa, qb), (ka, kb) = lengths[rank], lengths[src]
    nq, nk = qa + qb, ka + kb
    if not causal:
        blocks = [Block(0, nq, 0, nk, None)]
    elif src == rank:
        blocks = [Block(0, nq, 0, nk, "t")]
    elif src < rank:
        blocks = [Block(0, nq, 0, ka, None)]
    else:
        blocks = [Block(qa, nq, 0, nk, None)]
    return [b for b in blocks if b.q1 > b.q0 and b.k1 > b.k0]


def merge_attention(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor,
                    lse_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions of the same query rows over disjoint key sets, in float32:
    ``lse' = logaddexp(lse, lse_i)``, ``out' = exp(lse - lse') * out + exp(lse_i - lse') * out_i``.
    ``out`` / ``out_i`` are ``[B, H, S, D]``, ``lse`` / ``lse_i`` ``[B, H, S]``; a row whose keys
    are all masked has lse ``-inf`` and weight 0 (a row with ``-inf`` on both sides stays 0 /
    ``-inf``, not NaN). Returns new tensors ``(out', lse')``."""
    lse, lse_i = lse.float(), lse_i.float()
    new = torch.logaddexp(lse, lse_i)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w, w_i = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_i - safe).unsqueeze(-1)
    return w * out.float() + w_i * out_i.float(), new


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
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


def _check_local(q, k, v, causal, scale, layout, return_lse, device) -> tuple[list[int], float]:
    """This rank's arguments: ([B, Hq, Hk, S, Dq, Dv, dtype, layout], scale), or an error naming the
    argument. Not yet checked against the other ranks."""
    from .spec import check_scale
    from .targets import resolve_device

    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
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
    resolve_device(device)
    return [B, Hq, Hk, S, Dq, Dv, _DTYPES.index(q.dtype), _LAYOUTS.index(layout)], check_scale(scale, Dq)


def _bhsd_shape(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    b, x1, x2, d = x.shape
    return (b, x1, x2, d) if layout == "bhsd" else (b, x2, x1, d)


_META = ("batch", "q heads", "k/v heads", "shard length", "q/k head dim", "v head dim", "dtype", "layout",
         "causal", "scale")


def _gather_meta(local, error: Exception | None, causal: bool, group, world: int, device) -> list[list[int]]:
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
    return _LAYOUTS[value] if what == "layout" else value


def _check_meta(meta: list[list[int]], rank: int, error: Exception | None) -> list[tuple[int, int]]:
    """Raise (on every rank alike) unless all ranks agree; return every rank's chunk lengths."""
    if error is not None:
        raise error
    bad = [r for r, m in enumerate(meta) if m[0]]
    if bad:
        raise ValueError(f"ranks {bad} of the group refused their arguments (their error says why)")
    for i, what in enumerate(_META):
        if what != "shard length" and len({m[i + 1] for m in meta}) > 1:
            raise ValueError(f"ranks disagree on {what}: {[_shown(what, m[i + 1]) for m in meta]} (rank order); "
                             "every rank must call with the same heads, head dims, dtype, layout, causal and scale")
    lens = [m[4] for m in meta]
    lengths = shard_lengths(sum(lens), len(meta))
    if lens != [a + b for a, b in lengths]:
        raise ValueError(f"shard lengths {lens} (rank order) do not follow the load-balanced layout of S={sum(lens)} "
                         f"over {len(meta)} ranks, {[a + b for a, b in lengths]} (see shard_sequence)")
    return lengths


def _exchange(cur: torch.Tensor, send_len: int, recv_len: int, rank: int, world: int,
              group) -> tuple[list, torch.Tensor]:
    """Start sending ``cur`` to the next rank and receiving the previous rank's block (of
    ``recv_len`` rows) into a new tensor; returns (work handles, receive buffer). Empty blocks are
    neither sent nor received (both sides know the lengths)."""
    shape = list(cur.shape)
    shape[2] = recv_len
    buf = cur.new_empty(shape)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    ops = []
    if send_len:
        ops.append(dist.P2POp(dist.isend, cur, nxt, group))
    if recv_len:
        ops.append(dist.P2POp(dist.irecv, buf, prv, group))
    return (dist.batch_isend_irecv(ops) if ops else []), buf


def _ring(q: torch.Tensor, kv: torch.Tensor, dq: int, lengths, rank: int, world: int, group, causal: bool,
          scale: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring over ``bhsd`` q ``[B, Hq, S, Dq]`` and packed ``kv`` ``[B, Hk, S, Dq + Dv]``:
    float32 ``(out [B, Hq, S, Dv], lse [B, Hq, S])``. The next block's exchange is issued before the
    current block is computed, and waited for after."""
    from .api import fmha_fwd

    B, Hq, S, _ = q.shape
    out = torch.zeros(B, Hq, S, kv.shape[-1] - dq, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, S), -math.inf, dtype=torch.float32, device=q.device)
    cur = kv
    for step in range(world):
        src = (rank - step) % world
        works, nxt = [], None
        if step + 1 < world:
            send_len, recv_len = sum(lengths[src]), sum(lengths[(src - 1) % world])
            works, nxt = _exchange(cur, send_len, recv_len, rank, world, group)
        for b in ring_blocks(rank, src, lengths, causal):
            keys = cur[:, :, b.k0:b.k1]
            o, l_ = fmha_fwd(q[:, :, b.q0:b.q1], keys[..., :dq], keys[..., dq:], mask=b.mask, scale=scale,
                             return_lse=True, device=device)
            o, l_ = o.to(q.device), l_.to(q.device)
            out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1] = merge_attention(out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1],
                                                                         o, l_)
        for w in works:
            w.wait()
        cur = nxt
    return out, lse


def _comm_device(group, q) -> torch.device:
    """Where small collectives' tensors live: NCCL needs CUDA, other backends take CPU tensors."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return q.device if isinstance(q, torch.Tensor) and q.is_cuda else torch.device("cuda", torch.cuda.current_device())


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: dist.ProcessGroup | None = None, causal: bool = False, scale: float | None = None,
                               layout: str = "bhsd", device: str | None = None, return_lse: bool = False):
    """Attention of this rank's queries over the whole (sharded) sequence, ring-style.

    A collective over ``group`` (default: the world group): every rank calls it with its own shard
    of q, k and v in the load-balanced layout (:func:`shard_sequence`) and the same ``causal``,
    ``scale``, ``layout``, dtype, batch, heads and head dims. What is synchronised: one
    ``all_gather`` of a few int64 per rank first (the arguments are checked against every rank's,
    so a mismatch is the same ValueError on every rank instead of a hang), then ``N - 1`` ring
    steps, each sending this rank's current K/V block (K and V packed into one tensor) to rank
    ``r + 1`` and receiving rank ``r - 1``'s with ``batch_isend_irecv``; the exchange for the next
    step is started before the current block is computed and waited for before the next step. No
    barrier at the end: a rank returns once its last block is merged.

    Args:
        q, k, v: torch tensors of one dtype (float16, bfloat16, float32) on one device (CPU with
            ``gloo``, CUDA with ``nccl``); ``layout="bhsd"``: q ``[B, Hq, S_r, Dq]``, k
            ``[B, Hk, S_r, Dq]``, v ``[B, Hk, S_r, Dv]`` (``bshd``: S and H swapped), ``S_r`` this
            rank's shard length, ``Hq % Hk == 0``. K and V are sharded like q (self-attention).
        group: the process group (ranks ordered as in the group).
        causal: causal attention over global positions (top-left, ``j <= i``); else unmasked.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(Dq)``.
        layout: ``"bhsd"`` or ``"bshd"``.
        device: the IREE device URI each ``fmha_fwd`` call runs on (default ``"local-task"``, the
            CPU); on GPUs, this rank's own, e.g. ``f"cuda://{local_rank}"``.
        return_lse: also return float32 ``lse [B, Hq, S_r]`` (natural log).

    Each ring step is one ``fmha_fwd(..., return_lse=True)`` call (:func:`ring_blocks`: causal
    pairs of chunks are unmasked, causal top-left or skipped); partials merge in float32
    (:func:`merge_attention`; ``fmha_fwd`` returns each partial in the input dtype, so float16 /
    bfloat16 partials are rounded once before that merge). The blocks are computed inside IREE in ``bhsd`` (``bshd`` inputs
    are transposed views; ``fmha_fwd`` copies its inputs to contiguous host arrays either way).
    Today ``fmha_fwd`` takes torch tensors through host memory, so on GPUs every block's inputs
    and results cross the host bus; the call blocks until its block is done, so the exchange
    overlaps one block's compute at most. Returns ``out`` (the input's dtype, layout and device,
    ``Dv`` wide) or ``(out, lse)``.
    """
    world, rank = _group_info(group)
    error, local = None, None
    try:
        local = _check_local(q, k, v, causal, scale, layout, return_lse, device)
    except (TypeError, ValueError) as e:
        error = e
    meta = _gather_meta(local, error, causal, group, world, _comm_device(group, q))
    lengths = _check_meta(meta, rank, error)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    dq = q.shape[-1]
    kv = torch.cat([k, v], -1).contiguous()
    out, lse = _ring(q, kv, dq, lengths, rank, world, group, causal, local[1], device)
    out = out.to(q.dtype)
    if layout == "bshd":
        out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out
