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

Devices: the blocks run where the tensors are. CUDA tensors are shared with IREE in place
(``fmha_iree.runtime.torch_gpu``: no host copy; each call waits on the host for torch's stream before it
starts and for its results after, so one rank's block calls run one after another while the
ring's exchange for the next step proceeds on NCCL's streams). Each block is one
:func:`fmha_iree.fmha_fwd` call (compiled on first use) or, given ``module=``, one call of a module
loaded with :func:`fmha_iree.load`, which needs no compiler on the ranks' machines.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .distributed_args import check_local, check_meta, gather_meta, group_info

__all__ = ["Block", "chunk_bounds", "shard_lengths", "shard_sequence", "unshard_sequence", "gather_sequence",
           "ring_blocks", "merge_attention", "context_parallel_attention"]


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
    world, _ = group_info(group)
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


def _exchange(cur: tuple[torch.Tensor, ...], send_len: int, recv_len: int, rank: int, world: int,
              group) -> tuple[list, tuple[torch.Tensor, ...]]:
    """Start sending the tensors ``cur`` (K and V) to the next rank and receiving the previous
    rank's (of ``recv_len`` rows) into new tensors; returns (work handles, receive buffers). Empty
    blocks are neither sent nor received (both sides know the lengths)."""
    bufs = []
    for x in cur:
        shape = list(x.shape)
        shape[2] = recv_len
        bufs.append(x.new_empty(shape))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    ops = []
    if send_len:
        ops += [dist.P2POp(dist.isend, x, nxt, group) for x in cur]
    if recv_len:
        ops += [dist.P2POp(dist.irecv, x, prv, group) for x in bufs]
    return (dist.batch_isend_irecv(ops) if ops else []), tuple(bufs)


def _block_runner(module, device, scale: float):
    """``run(q, k, v, mask) -> (out, lse)`` on ``bhsd`` blocks (``mask`` None or ``"t"``): a call of
    the loaded ``module`` in its own layout, or :func:`fmha_iree.fmha_fwd` on ``device``."""
    if module is None:
        from ..api import fmha_fwd

        return lambda q, k, v, mask: fmha_fwd(q, k, v, mask=mask, scale=scale, return_lse=True, device=device)
    swap = module.manifest["problem"]["layout"] == "bshd"

    def run(q, k, v, mask):
        # "0": unmasked, whatever default mask the module was compiled with
        args = (x.transpose(1, 2) for x in (q, k, v)) if swap else (q, k, v)
        o, l_ = module(*args, mask=mask or "0", scale=scale, return_lse=True)
        return (o.transpose(1, 2) if swap else o), l_

    return run


def _merge_rows(out, lse, o, l_, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` with rows ``q0:q1`` merged with a block's ``(o, l_)``, as new tensors (the
    state may be a block's result, which this never writes)."""
    m_out, m_lse = merge_attention(out[:, :, q0:q1], lse[:, :, q0:q1], o, l_)
    if (q0, q1) == (0, out.shape[2]):
        return m_out, m_lse
    return (torch.cat([out[:, :, :q0].float(), m_out, out[:, :, q1:].float()], 2),
            torch.cat([lse[:, :, :q0], m_lse, lse[:, :, q1:]], 2))


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, rank: int, world: int, group,
          causal: bool, run) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring over contiguous ``bhsd`` q ``[B, Hq, S, Dq]``, k ``[B, Hk, S, Dq]`` and v ``[B, Hk,
    S, Dv]``, each block computed by ``run`` (:func:`_block_runner`): ``(out [B, Hq, S, Dv], lse
    [B, Hq, S])``, ``out`` float32 once a later block merged into it (in the inputs' dtype where
    none did), ``lse`` float32. The next block's exchange is issued before the current block is
    computed, and waited for after. The first step (this rank's own K / V) covers every query row
    (:func:`ring_blocks`), so its result is the state the later steps merge into."""
    out = lse = None
    cur = (k, v)
    for step in range(world):
        src = (rank - step) % world
        works, nxt = [], None
        if step + 1 < world:
            send_len, recv_len = sum(lengths[src]), sum(lengths[(src - 1) % world])
            works, nxt = _exchange(cur, send_len, recv_len, rank, world, group)
        for b in ring_blocks(rank, src, lengths, causal):
            o, l_ = run(q[:, :, b.q0:b.q1], cur[0][:, :, b.k0:b.k1], cur[1][:, :, b.k0:b.k1], b.mask)
            o, l_ = o.to(q.device), l_.to(q.device, torch.float32)
            out, lse = (o, l_) if out is None else _merge_rows(out, lse, o, l_, b.q0, b.q1)
        for w in works:
            w.wait()
        cur = nxt
    if out is None:  # no query row on this rank
        B, Hq, S, _ = q.shape
        out = q.new_zeros(B, Hq, S, v.shape[-1], dtype=torch.float32)
        lse = q.new_full((B, Hq, S), -math.inf, dtype=torch.float32)
    return out, lse


def _layout_lengths(lens: list[int]) -> list[tuple[int, int]]:
    """Every rank's two chunk lengths, from the shard lengths the ranks gave (rank order); a
    ValueError unless they follow the load-balanced layout."""
    lengths = shard_lengths(sum(lens), len(lens))
    if lens != [a + b for a, b in lengths]:
        raise ValueError(f"shard lengths {lens} (rank order) do not follow the load-balanced layout of S={sum(lens)} "
                         f"over {len(lens)} ranks, {[a + b for a, b in lengths]} (see shard_sequence)")
    return lengths


def _comm_device(group, q) -> torch.device:
    """Where small collectives' tensors live: NCCL needs CUDA, other backends take CPU tensors."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return q.device if isinstance(q, torch.Tensor) and q.is_cuda else torch.device("cuda", torch.cuda.current_device())


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: dist.ProcessGroup | None = None, causal: bool = False, scale: float | None = None,
                               layout: str = "bhsd", device: str | None = None, module=None,
                               return_lse: bool = False):
    """Attention of this rank's queries over the whole (sharded) sequence, ring-style.

    A collective over ``group`` (default: the world group): every rank calls it with its own shard
    of q, k and v in the load-balanced layout (:func:`shard_sequence`) and the same ``causal``,
    ``scale``, ``layout``, dtype, batch, heads and head dims. What is synchronised: one
    ``all_gather`` of a few int64 per rank first (the arguments are checked against every rank's,
    so a mismatch is the same ValueError on every rank instead of a hang), then ``N - 1`` ring
    steps, each sending this rank's current K and V blocks to rank
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
        device: the IREE device URI each ``fmha_fwd`` call runs on (default: the CPU for CPU
            tensors, the tensors' own GPU for CUDA tensors); on GPUs, this rank's own, e.g.
            ``f"cuda://{local_rank}"``.
        module: a module loaded with :func:`fmha_iree.load` on this rank's device, which then
            computes every block instead of ``fmha_fwd`` (no compiler needed); its dtype, heads
            and head dims must be the call's, any layout and default mask (each block passes its
            own). Give ``module`` or ``device``, not both.
        return_lse: also return float32 ``lse [B, Hq, S_r]`` (natural log).

    Each ring step is one call with the LSE (:func:`ring_blocks`: causal pairs of chunks are
    unmasked, causal top-left or skipped); partials merge in float32 (:func:`merge_attention`; each
    partial comes back in the input dtype, so float16 / bfloat16 partials are rounded once before
    that merge). Blocks are ``bhsd`` views of the shards (transposed views for ``bshd`` inputs and
    modules). Returns ``out`` (the input's dtype, layout and device, ``Dv`` wide) or ``(out, lse)``.
    """
    world, rank = group_info(group)
    error, local = None, None
    try:
        local = check_local(q, k, v, causal, scale, layout, return_lse, device, module)
    except (TypeError, ValueError) as e:
        error = e
    meta = gather_meta(local, error, causal, group, world, _comm_device(group, q))
    lengths = _layout_lengths(check_meta(meta, error))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, lse = _ring(q, k, v, lengths, rank, world, group, causal, _block_runner(module, device, local[1]))
    out = out.to(q.dtype)
    if layout == "bshd":
        out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out
