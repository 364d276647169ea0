#!/usr/bin/env python3
"""Decode at every group size: one query per sequence against Sk keys, G = Hq / Hk query heads per
KV head (Hk fixed, so every G reads the same K / V bytes), in batch mode, group mode and from a
paged cache, against torch SDPA (each CUDA backend that takes the shape) in the same process.

GPU (modules compiled elsewhere, one bshd module per G: `fmha-iree compile --target sm_80 --dtype
f16 --hdim 128 --heads <8G>:8 --layout bshd -o DIR/g<G>.vmfb`):
    python scripts/bench_decode.py --device cuda://0 --modules DIR [--groups 1,2,4,8,16,32]
        [--batches 1,16,64] [--sk 8192] [--out OUT]

GB/s counts the K and V bytes the call must read (B * Sk * Hk * (Dq + Dv) * 2); our calls take
DeviceTensors uploaded once, issued back to back and closed by a wait (best of 3 blocks); torch is
timed with CUDA events. `path` is the route each call took (`DeployedFmha.route`), `max_abs_diff`
the largest difference from torch's math backend in float32. Writes a table to stdout and, with
--out, bench.json and bench.csv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from _timing import cuda_time, device_time, median_time, write_rows


def find_modules(folder: str) -> dict[int, tuple[Path, int | None]]:
    """The folder's bshd modules without compiled-in lengths, by group size: (path, the KV heads
    its manifest records, if any: a module compiled with --heads takes those counts only)."""
    found = {}
    for f in sorted(Path(folder).glob("*.json")):
        man = json.loads(f.read_text())
        pr = man.get("problem", {})
        if pr.get("layout") == "bshd" and not (man["capabilities"].get("dense") or {}).get("seqlens"):
            found.setdefault(int(pr["group"]), (f.with_suffix(".vmfb"), pr.get("kv_heads")))
    return found


def torch_peers(q, k, v, reps) -> dict:
    """torch SDPA on [B, H, 1, D] / [B, Hk, Sk, D] under each backend that takes the call (on the
    CPU, a smoke run of the script: its one backend, wall time)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    times = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            fn()
            times[name] = cuda_time(fn, reps) if q.is_cuda else median_time(fn, reps)
        except RuntimeError as e:  # the backend does not take this shape / GQA
            times[name] = None
            print(f"    torch {name}: {str(e).splitlines()[0][:100]}")
    return times, _reference(qt, kt, vt)


def _reference(qt, kt, vt):
    """float32 decode attention, ``[B, 1, Hq, Dv]``: the query heads of a KV head as rows of one
    product (SDPA's math path repeats K / V per query head: 32 GiB at G16 B64 Sk8192)."""
    import torch

    B, Hq, _, D = qt.shape
    Hk = kt.shape[1]
    q = qt.float().reshape(B, Hk, Hq // Hk, D)
    s = torch.softmax(q @ kt.float().transpose(2, 3) / D ** 0.5, dim=-1)  # [B, Hk, G, Sk]
    return (s @ vt.float()).reshape(B, Hq, 1, -1).transpose(1, 2)


def calls(mod, q, k, v, rng, page: int):
    """Our three decode calls on DeviceTensors: batch mode, group mode over packed K / V, a paged
    cache whose pages are shuffled. Each is (name, call, route)."""
    import fmha_iree

    B, Sk, Hk, D = k.shape
    gpu = not mod.device_uri.startswith("local")  # the CPU's group-mode calls read host arrays
    up = (lambda x: fmha_iree.to_device(x, mod.device_uri)) if gpu else (lambda x: x)  # noqa: E731
    qb, kb, vb = up(q), up(k), up(v)
    qg, kg, vg = up(q[:, 0]), up(k.reshape(B * Sk, Hk, D)), up(v.reshape(B * Sk, Hk, -1))
    sq = np.arange(B + 1, dtype=np.int32)
    sk = (np.arange(B + 1) * Sk).astype(np.int32)
    pages = rng.permutation(B * Sk // page).astype(np.int32)
    table = pages.reshape(B, Sk // page)
    kc = np.empty((B * Sk // page, page, Hk, D), k.dtype)
    vc = np.empty((B * Sk // page, page, Hk, v.shape[-1]), v.dtype)
    kc[table.reshape(-1)] = k.reshape(B * Sk // page, page, Hk, D)
    vc[table.reshape(-1)] = v.reshape(B * Sk // page, page, Hk, -1)
    kp, vp = up(kc), up(vc)
    lens = np.full(B, Sk, np.int32)
    return [
        ("batch", lambda: mod(qb, kb, vb), mod.route(qb, kb, vb)),
        ("group", lambda: mod.varlen(qg, kg, vg, sq, sk), mod.route(qg, kg, vg, seqstart_q=sq, seqstart_k=sk)),
        ("paged", lambda: mod.varlen(qg, kp, vp, sq, None, seqlen_k=lens, block_table=table),
         mod.route(qg, kp, vp, seqstart_q=sq, seqlen_k=lens, block_table=table)),
    ]


def run_case(mod, G, B, args, rng, hk=None) -> list[dict]:
    import torch

    Hk, D, Sk = hk or args.hk, args.hdim, args.sk
    Hq = Hk * G
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float16)
    k = rng.standard_normal((B, Sk, Hk, D)).astype(np.float16)
    v = rng.standard_normal((B, Sk, Hk, D)).astype(np.float16)
    nbytes = B * Sk * Hk * 2 * D * 2
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    peers, ref = torch_peers(*(torch.from_numpy(x).to(dev) for x in (q, k, v)), args.reps)
    ref = ref.cpu().numpy()
    best_peer = min((t for t in peers.values() if t), default=None)
    rows = []
    for name, fn, route in calls(mod, q, k, v, rng, args.page):
        t = device_time(fn, args.reps)
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out = np.asarray(out.to_numpy() if hasattr(out, "to_numpy") else out, np.float32)
        diff = float(np.abs(out.reshape(ref.shape) - ref).max())
        row = dict(G=G, B=B, Hq=Hq, Hk=Hk, Sk=Sk, D=D, call=name, path=route.path, entry=route.entry, ms=t * 1e3,
                   gbps=nbytes / t / 1e9, max_abs_diff=diff,
                   **{f"torch_{p}_ms": (pt * 1e3 if pt else None) for p, pt in peers.items()},
                   ratio_vs_best_torch=(best_peer / t if best_peer else None))
        print(f"G{G:<3} B{B:<3} {name:6} {route.path + '/' + str(route.entry):26} {t * 1e3:8.4f} ms {row['gbps']:7.0f} GB/s"
              f"  best torch {best_peer * 1e3 if best_peer else float('nan'):8.4f} ms"
              f"  x{row['ratio_vs_best_torch'] or float('nan'):.2f}  diff {diff:.1e}", flush=True)
        rows.append(row)
    return rows


def main():
    import fmha_iree

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda://0")
    ap.add_argument("--modules", required=True)
    ap.add_argument("--groups", default="1,2,4,8,16,32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--sk", type=int, default=8192)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    modules = find_modules(args.modules)
    rng = np.random.default_rng(0)
    rows = []
    for G in (int(g) for g in args.groups.split(",")):
        if G not in modules:
            print(f"G{G}: no bshd module in {args.modules}")
            continue
        path, hk = modules[G]
        mod = fmha_iree.load(path, device=args.device)
        for B in (int(b) for b in args.batches.split(",")):
            rows += run_case(mod, G, B, args, rng, hk)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
