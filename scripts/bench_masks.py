#!/usr/bin/env python3
"""How the cost of masked attention follows the visible work (core issue's benchmark).

Times fmha_iree unmasked, causal and a ``b:256,0`` window at one shape, with torch SDPA on the same
inputs in the same run as the peer, and reports each time relative to fmha_iree's unmasked time.
Then measures the peak resident memory of a causal call at ``--mem-seqlen`` in a fresh process.

    python scripts/bench_masks.py --seqlen 4096 --heads 8 --hdim 64 --mem-seqlen 32768
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

from _timing import median_time


def bench(args):
    import torch

    import fmha_iree

    torch.manual_seed(0)
    B, H, S, D = args.batch, args.heads, args.seqlen, args.hdim
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    rows = []
    base = None
    for name, mask in (("none", None), ("causal b", "b"), ("window b:256,0", "b:256,0")):
        t = median_time(lambda: fmha_iree.fmha_fwd(q, k, v, mask=mask), args.reps)
        if mask is None:
            base = t
            peer = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.reps)
        elif mask == "b":
            peer = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), args.reps)
        else:
            vis = torch.from_numpy(fmha_iree.Mask.from_str(mask).materialize(S, S))
            peer = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=vis), args.reps)
        rows.append({"mask": name, "fmha_iree_ms": t * 1e3, "vs_unmasked": t / base, "torch_sdpa_ms": peer * 1e3,
                     "speed_vs_torch": peer / t})
    return rows


def peak_memory(args):
    """Peak RSS (MiB) of a child process that runs one causal call at --mem-seqlen."""
    code = (
        "import resource, torch, fmha_iree\n"
        f"S={args.mem_seqlen}\n"
        "q, k, v = (torch.randn(1, 1, S, 64) for _ in range(3))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "o = fmha_iree.fmha_fwd(q, k, v, mask='b')\n"
        "assert torch.isfinite(o).all()\n"
        "print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    before, after = (int(x) for x in out.split()[-2:])
    return {"seqlen": args.mem_seqlen, "peak_rss_mib": after / 1024, "rss_before_call_mib": before / 1024}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem-seqlen", type=int, default=32768, help="0 skips the memory measurement")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    print(f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, "
          f"f32 B={args.batch} H={args.heads} S={args.seqlen} D={args.hdim}, median of {args.reps}")
    rows = bench(args)
    print(f"{'mask':<16}{'fmha_iree ms':>14}{'/ unmasked':>12}{'torch ms':>10}{'speed vs torch':>16}")
    for r in rows:
        print(f"{r['mask']:<16}{r['fmha_iree_ms']:>14.1f}{r['vs_unmasked']:>12.3f}{r['torch_sdpa_ms']:>10.1f}"
              f"{r['speed_vs_torch']:>16.2f}")
    result = {"rows": rows, "args": vars(args)}
    if args.mem_seqlen:
        mem = peak_memory(args)
        result["memory"] = mem
        print(f"causal S={mem['seqlen']} H=1 D=64 f32: peak RSS {mem['peak_rss_mib']:.0f} MiB "
              f"(process before the call: {mem['rss_before_call_mib']:.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
