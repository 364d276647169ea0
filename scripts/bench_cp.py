#!/usr/bin/env python3
"""Context-parallel (ring) attention on N GPUs: ``fmha_iree.integrations.distributed.context_parallel_attention``
against torch's ``context_parallel`` over SDPA flash on the same ranks, and fmha_iree on one GPU
(rank 0 alone, the whole sequence), same inputs, same run.

    torchrun --nproc-per-node 8 scripts/bench_cp.py --seqlens 32768,65536,131072 --device cuda://0 --out cp.json
    # CPU smoke check (gloo, no torch peer):
    torchrun --nproc-per-node 2 scripts/bench_cp.py --device local-task --seqlens 64,96 --heads 4:2 --hdim 32 \\
        --dtype f32 --reps 2

Rows: B1 Hq32 Hk8 D128 bf16 by default, causal and unmasked, for each of --seqlens. Each rank uses
its own GPU (``--device cuda://0`` means ``cuda://LOCAL_RANK`` on every rank; torch on
``cuda:LOCAL_RANK``, ``nccl``); ``local-task`` runs every rank on the CPU over ``gloo``. The CUDA
target of the modules fmha_iree compiles comes from ``FMHA_IREE_CUDA_TARGET`` (default sm_80).

- ``ring``: fmha_iree's ring on every rank, inputs sharded in the load-balanced layout (torch
  tensors; CUDA tensors are shared with IREE in place). With ``--module`` every rank loads that
  module (``fmha_iree.load``, compiled ahead of time by ``fmha-iree compile`` for the rows' dtype,
  heads and head dim) and the ring and ``one_gpu`` call it: no compiler on the ranks' machine.
- ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` over
  ``scaled_dot_product_attention`` restricted to the flash backend (its default head-tail load
  balancing for causal, none for unmasked). Flash SDPA takes no GQA here, so K/V are expanded to
  Hq heads (``--torch-gqa expand``, recorded in the JSON) unless ``--torch-gqa native``. Only on
  CUDA, and only where the torch build has it; otherwise the row says why and shows no time.
- ``one_gpu``: rank 0 alone, ``fmha_fwd`` over the whole sequence on DeviceTensors (uploaded once,
  results left on the device, closed by a wait), the other ranks waiting at a barrier.

The distributed times are wall time per call over ``--reps`` back-to-back calls after one untimed
warm-up (compiles happen there), between barriers, the slowest rank's; the one-GPU time is the
best of 3 such blocks. TFLOP/s are derived from those times (4·B·Hq·S²·D, times (S+1)/2S when
causal). Agreement: the max |difference| of ring and torch_cp against one_gpu, on the output rank 0
holds (ring) or on torch's unsharded output (torch_cp). Printed and written (``--out``, rank 0)
are only the figures measured in this run.

Device memory (CUDA): ``<peer>_mem_gib`` is the GPU memory in use once the peer's calls are done
(``torch.cuda.mem_get_info``, torch's cache emptied first) less what was in use before the first
row, the largest over the ranks that ran it: the row's inputs, torch's live tensors and the
buffers IREE keeps for reuse (``FMHA_IREE_CUDA_CACHE_BYTES``). IREE's kept buffers and the inputs
of earlier rows stay in the figure of later peers and rows, so a per-peer working set is read from
a process that runs one peer and one length (``--peers ring --seqlens 131072``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist

import fmha_iree
from fmha_iree.integrations.distributed import context_parallel_attention, shard_sequence

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def _args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="32768,65536,131072", help="global sequence lengths, comma-separated")
    ap.add_argument("--device", default="cuda://0", help="cuda://0 (each rank: cuda://LOCAL_RANK) or local-task")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="32:8", help="Hq:Hk")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--mask", choices=("both", "causal", "none"), default="both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peers", default="ring,torch_cp,one_gpu", help="which of ring, torch_cp, one_gpu to run")
    ap.add_argument("--torch-gqa", choices=("expand", "native"), default="expand",
                    help="torch_cp: expand K/V to Hq heads (flash SDPA has no GQA) or pass enable_gqa=True")
    ap.add_argument("--module", help="a .vmfb from fmha-iree compile that every rank loads and calls "
                    "(default: fmha_fwd, compiling on first use)")
    ap.add_argument("--out", help="JSON file (written by rank 0)")
    return ap.parse_args()


def _setup(device: str):
    """(rank, world, IREE device of this rank, torch device) after init_process_group: GPU drivers
    (cuda, hip: torch's "cuda" device on ROCm too) get ``<driver>://LOCAL_RANK`` and ``nccl``."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    driver, sep, _ = device.partition("://")
    cuda = driver in ("cuda", "hip")
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    iree_device = f"{driver}://{local}" if sep else device
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), iree_device, dev


def _mem_used(dev: torch.device) -> int:
    """Bytes in use on ``dev``'s GPU (every process's), torch's cache emptied first; 0 on the CPU."""
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def _sync(dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _dist_time(fn, reps: int, dev: torch.device) -> float:
    """Seconds per call, the slowest rank's: one untimed call, then ``reps`` calls between barriers."""
    fn()
    _sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    t = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _inputs(S: int, args, dev: torch.device):
    """The global q, k, v (bhsd), the same on every rank (one seed)."""
    hq, hk = (int(x) for x in args.heads.split(":"))
    g = torch.Generator(device=dev).manual_seed(S)
    dt = DTYPES[args.dtype]
    q = torch.randn(args.batch, hq, S, args.hdim, generator=g, device=dev, dtype=torch.float32).to(dt)
    k = torch.randn(args.batch, hk, S, args.hdim, generator=g, device=dev, dtype=torch.float32).to(dt)
    v = torch.randn(args.batch, hk, S, args.hdim, generator=g, device=dev, dtype=torch.float32).to(dt)
    return q, k, v


def _ring(q, k, v, causal, rank, world, iree_device, args, dev):
    shards = [shard_sequence(x, rank, world, 2) for x in (q, k, v)]
    where = {"module": args.loaded} if args.loaded is not None else {"device": iree_device}
    fn = lambda: context_parallel_attention(*shards, causal=causal, **where)  # noqa: E731
    return _dist_time(fn, args.reps, dev), fn()


def _torch_cp(q, k, v, causal, world, args, dev):
    """(seconds, unsharded output, note) of torch's context parallel SDPA; raises when it cannot run."""
    if dev.type != "cuda":
        raise RuntimeError("needs CUDA (SDPA flash)")
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = args.torch_gqa == "native" or q.shape[1] == k.shape[1]
    if not gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    q, k, v = (x.clone() for x in (q, k, v))  # context_parallel shards its buffers in place
    mesh = init_device_mesh("cuda", (world,))
    old = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = causal  # torch refuses load balancing without a causal mask
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context_parallel(
                mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            kw = {"enable_gqa": True} if gqa and q.shape[1] != k.shape[1] else {}
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)  # noqa: E731
            t = _dist_time(fn, args.reps, dev)
            out = fn()
        (full,) = context_parallel_unshard(mesh, [out], [2])
    finally:
        _cp_options.enable_load_balance = old
    return t, full, "K/V native GQA" if kw else ("K/V expanded to Hq heads" if not gqa else "")


def _one_gpu(q, k, v, causal, iree_device, args):
    """(seconds, output as torch) of fmha_fwd on DeviceTensors, best of 3 blocks of --reps calls."""
    qd, kd, vd = (fmha_iree.to_device(x, iree_device) for x in (q, k, v))
    mask = "t" if causal else "0"
    if args.loaded is not None:
        call = lambda: args.loaded(qd, kd, vd, mask=mask)  # noqa: E731
    else:
        call = lambda: fmha_iree.fmha_fwd(qd, kd, vd, mask=mask, device=iree_device)  # noqa: E731
    call().wait()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(args.reps):
            res = call()
        res.wait()
        best = min(best, (time.perf_counter() - t0) / args.reps)
    return best, call().to_torch()


def _peer(name, row, fn, ctx, every_rank=True):
    """Run one peer into ``row`` (``<name>_ms``, or ``<name>_skipped`` with the reason), and its
    device memory (``<name>_mem_gib``: the module docstring; over every rank when ``every_rank``)."""
    try:
        t, out, *note = fn()
    except Exception as e:  # a peer that cannot run here: say why, show no figure
        row[f"{name}_ms"], row[f"{name}_skipped"] = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return None
    dev, base = ctx[3], ctx[4]
    if dev.type == "cuda":
        used = torch.tensor([_mem_used(dev) - base], dtype=torch.float64, device=dev)
        if every_rank:
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
        row[f"{name}_mem_gib"] = float(used.item()) / 2**30
    row[f"{name}_ms"] = t * 1e3
    row[f"{name}_tflops"] = row["flop"] / t / 1e12
    if note and note[0]:
        row[f"{name}_note"] = note[0]
    return out


def bench_row(S, causal, ctx, args):
    rank, world, iree_device, dev, _ = ctx
    q, k, v = _inputs(S, args, dev)
    B, hq, _, D = q.shape
    row = dict(B=B, Hq=hq, Hk=k.shape[1], S=S, D=D, dtype=args.dtype, mask="causal" if causal else "none",
               ranks=world, flop=4 * B * hq * S * S * D * ((S + 1) / (2 * S) if causal else 1.0))
    peers = args.peers.split(",")
    ring = _peer("ring", row, lambda: _ring(q, k, v, causal, rank, world, iree_device, args, dev), ctx) \
        if "ring" in peers else None
    cp = _peer("torch_cp", row, lambda: _torch_cp(q, k, v, causal, world, args, dev), ctx) \
        if "torch_cp" in peers else None
    one = None
    if "one_gpu" in peers:
        if rank == 0:
            one = _peer("one_gpu", row, lambda: _one_gpu(q, k, v, causal, iree_device, args), ctx, False)
        dist.barrier()
    if one is not None:
        one = one.to(dev).float()
        if ring is not None:
            row["ring_max_abs_diff"] = (ring.float() - shard_sequence(one, 0, world, 2)).abs().max().item()
        if cp is not None:
            row["torch_cp_max_abs_diff"] = (cp.float() - one).abs().max().item()
    return row


def _fmt(row, name):
    if row.get(f"{name}_ms") is None:
        return f"{'-':>10} {'':>7}" if f"{name}_skipped" not in row else f"{'skipped':>10} {'':>7}"
    return f"{row[f'{name}_ms']:10.2f} {row[f'{name}_tflops']:7.3g}"


def report(rows, args, world):
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} ranks={world} device={args.device} "
          f"torch={torch.__version__}")
    print(f"{'S':>7} {'mask':<6} | {'ring ms':>10} {'TFLOP/s':>7} | {'torch_cp ms':>10} {'TFLOP/s':>7} | "
          f"{'1-GPU ms':>10} {'TFLOP/s':>7} | diff ring / torch_cp")
    for r in rows:
        diffs = " / ".join(f"{r[k]:.1e}" if k in r else "-" for k in ("ring_max_abs_diff", "torch_cp_max_abs_diff"))
        cols = " | ".join(_fmt(r, name) for name in ("ring", "torch_cp", "one_gpu"))
        print(f"{r['S']:>7} {r['mask']:<6} | {cols} | {diffs}")
    for r in rows:
        mem = [f"{name} {r[name + '_mem_gib']:.2f}" for name in ("ring", "torch_cp", "one_gpu") if name + "_mem_gib" in r]
        if mem:
            print(f"  S={r['S']} {r['mask']}: device memory GiB (rank max) " + ", ".join(mem))
        for k, v in r.items():
            if k.endswith(("_skipped", "_note")):
                print(f"  S={r['S']} {r['mask']}: {k} {v}")


def main():
    args = _args()
    ctx = _setup(args.device)
    ctx = (*ctx, _mem_used(ctx[3]))
    args.loaded = fmha_iree.load(args.module, device=ctx[2]) if args.module else None
    rows = []
    masks = {"both": (True, False), "causal": (True,), "none": (False,)}[args.mask]
    try:
        for S in (int(s) for s in args.seqlens.split(",")):
            for causal in masks:
                rows.append(bench_row(S, causal, ctx, args))
                if ctx[0] == 0:
                    print(f"done S={S} causal={causal}", flush=True)
        if ctx[0] == 0:
            report(rows, args, ctx[1])
            if args.out:
                meta = dict(date=time.strftime("%Y-%m-%d"), host=platform.node(), torch=torch.__version__,
                            device=args.device, ranks=ctx[1], reps=args.reps, torch_gqa=args.torch_gqa,
                            module=args.module)
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=2)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
