#!/usr/bin/env python3
"""Group mode cost follows the work: one long sequence plus many short ones, against the long one
alone and against padding everything to the longest (batch mode), in one run.

    python scripts/bench_varlen.py --long 2048 --short 64 --count 32 --heads 8 --hdim 64
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from _timing import median_time


def main():
    import torch

    import fmha_iree

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--mask", default="b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="local-task")
    args = ap.parse_args()

    torch.manual_seed(0)
    H, D = args.heads, args.hdim
    lens = [args.long] + [args.short] * args.count
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(starts[-1])
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    one = np.array([0, args.long], np.int32)

    fmha_iree.fmha_fwd_varlen(q[:1], k[:1], v[:1], [0, 1], [0, 1], mask=args.mask, device=args.device)  # compile
    before = fmha_iree.cache_stats()["compiles"]
    t_long = median_time(lambda: fmha_iree.fmha_fwd_varlen(q[: args.long], k[: args.long], v[: args.long], one, one,
                                                            mask=args.mask, device=args.device), args.reps)
    t_mix = median_time(lambda: fmha_iree.fmha_fwd_varlen(q, k, v, starts, starts, mask=args.mask, device=args.device),
                         args.reps)
    compiles = fmha_iree.cache_stats()["compiles"] - before

    B = len(lens)
    qp, kp, vp = (torch.zeros(B, args.long, H, D) for _ in range(3))
    for b, (s, n) in enumerate(zip(starts[:-1], lens)):
        qp[b, :n], kp[b, :n], vp[b, :n] = q[s : s + n], k[s : s + n], v[s : s + n]
    t_pad = median_time(lambda: fmha_iree.fmha_fwd(qp, kp, vp, mask=args.mask, layout="bshd", device=args.device),
                         max(1, args.reps // 2))

    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {args.device}, f32 H={H} D={D} mask {args.mask!r}, "
          f"median of {args.reps}")
    print(f"1 x {args.long} alone:                         {t_long * 1e3:9.1f} ms   1.00")
    print(f"1 x {args.long} + {args.count} x {args.short} packed (varlen):      {t_mix * 1e3:9.1f} ms   {t_mix / t_long:.2f}")
    print(f"same batch padded to {args.long} (batch mode): {t_pad * 1e3:9.1f} ms   {t_pad / t_long:.2f}")
    print(f"compiles during the timed varlen calls (two batch compositions, after a warm-up with a third): {compiles}")


if __name__ == "__main__":
    main()
