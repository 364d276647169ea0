"""The main job in one command: compile FMHA for the CPU, run it, check it against torch.

    python -m fmha_iree.demo [--seqlen 300] [--mask b] [--dtype f16]
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    import torch

    import fmha_iree
    from fmha_iree.problem.targets import resolve_device
    from fmha_iree.problem.tiles import default_tiles

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=300)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--mask", default="b")
    ap.add_argument("--dtype", choices=("f16", "bf16", "f32"), default="f16")
    ap.add_argument("--device", default="local-task")
    args = ap.parse_args(argv)

    dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    B, H, Hk, S, D = args.batch, args.heads, args.kv_heads, args.seqlen, args.hdim
    q = torch.randn(B, H, S, D, dtype=dt)
    k = torch.randn(B, Hk, S, D, dtype=dt)
    v = torch.randn(B, Hk, S, D, dtype=dt)

    t0 = time.perf_counter()
    out, lse = fmha_iree.fmha_fwd(q, k, v, mask=args.mask, return_lse=True, device=args.device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fmha_iree.fmha_fwd(q, k, v, mask=args.mask, device=args.device)
    again = time.perf_counter() - t0

    mask = fmha_iree.Mask.from_str(args.mask)
    vis = torch.from_numpy(mask.materialize(S, S))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1), attn_mask=vis
    )
    err = (out.double() - ref).abs().max().item()
    _, target = resolve_device(args.device)
    tiles = default_tiles(target.family, D, D, target.arch, args.dtype)
    print(f"fmha_iree {fmha_iree.__version__}: q {list(q.shape)} k/v {list(k.shape)} {args.dtype}, mask {args.mask!r} ({mask.kind})")
    print(f"target {target.arch} ({target.backend}), device {args.device}")
    print(f"tile config (CK names): kM0={tiles.m0} kN0={tiles.n0} kK0={tiles.k0} kN1={tiles.n1} kK1={tiles.k1}"
          f" (kv_chunk {tiles.kv_chunk}) = {tiles.ck_name}")
    print(f"out {list(out.shape)} {out.dtype}, lse {list(lse.shape)} {lse.dtype}; out[0,0,0,:4] = {out[0, 0, 0, :4].tolist()}")
    print(f"max |out - torch float64 SDPA| = {err:.2e}")
    print(f"first call (compile or cache load + run) {first:.2f} s, second call {again * 1e3:.1f} ms; cache {fmha_iree.cache_stats()}")
    tol = {"f16": 2e-3, "bf16": 2e-2, "f32": 1e-5}[args.dtype]
    ok = err <= tol
    print("OK" if ok else f"MISMATCH (tolerance {tol})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
