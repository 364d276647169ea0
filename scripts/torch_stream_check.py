"""Check by hand on a CUDA GPU that fmha_iree calls on torch CUDA tensors are ordered against
torch's stream (``fmha_iree.runtime.torch_gpu``): inputs written late by torch, results read and inputs
overwritten by torch right after the call, calls back to back, on torch's default stream and on
a side stream, batch mode and group mode (a loaded module).

    python scripts/torch_stream_check.py BHSD_MODULE.vmfb BSHD_MODULE.vmfb [--device cuda://0]

Each call's inputs are written by torch behind about 2 ms of other GPU work, so a call that
read them before torch's stream got there would see the previous call's values; each result is
copied by torch right after the call and compared, after the loop, with torch's SDPA on the same
inputs (max |diff| printed; the script fails above 2e-2, f16).
"""

from __future__ import annotations

import argparse
import sys


def _busy(x):
    """About 2 ms of work on torch's current stream (matmuls on ``x``)."""
    for _ in range(8):
        x = (x @ x).clamp_(-1, 1)
    return x


def _batch_case(f, torch, dev, stream_ctx, calls: int):
    B, H, S, D = 2, 16, 512, 128
    g = torch.Generator(device="cpu").manual_seed(0)
    bases = [torch.randn(B, H, S, D, generator=g, dtype=torch.float16).to(dev) for _ in range(calls)]
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float16).to(dev) for _ in range(2))
    busy = torch.randn(2048, 2048, device=dev, dtype=torch.float16) / 64
    q = torch.empty_like(bases[0])
    kept = []
    with stream_ctx:
        for i in range(calls):
            _busy(busy)
            q.copy_(bases[i])  # written late: the call must see it
            out = f(q, k, v, mask="b")
            kept.append(out.clone())  # read right after the call
            q.zero_()  # overwritten right after the call: the call must have read it first
    torch.cuda.synchronize()
    worst = 0.0
    for i in range(calls):
        ref = torch.nn.functional.scaled_dot_product_attention(bases[i], k, v, is_causal=True)
        worst = max(worst, (kept[i].float() - ref.float()).abs().max().item())
    return worst


def _group_case(f, torch, dev, calls: int):
    import numpy as np

    lens = np.array([37, 300, 1, 129, 64, 500], np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pr = f.manifest["problem"]
    T, H, D = int(starts[-1]), pr.get("heads") or 16, pr["hdim"]
    hk = H // pr["group"]
    g = torch.Generator(device="cpu").manual_seed(1)
    bases = [torch.randn(T, H, D, generator=g, dtype=torch.float16).to(dev) for _ in range(calls)]
    k, v = (torch.randn(T, hk, D, generator=g, dtype=torch.float16).to(dev) for _ in range(2))
    busy = torch.randn(2048, 2048, device=dev, dtype=torch.float16) / 64
    q = torch.empty_like(bases[0])
    kept = []
    for i in range(calls):
        _busy(busy)
        q.copy_(bases[i])
        kept.append(f.varlen(q, k, v, starts, starts, mask="b").clone())
        q.zero_()
    torch.cuda.synchronize()
    worst = 0.0
    for i in range(calls):
        for b in range(len(lens)):
            s0, s1 = int(starts[b]), int(starts[b + 1])
            qs, ks, vs = (x[s0:s1].transpose(0, 1)[None] for x in (bases[i], k, v))
            ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            worst = max(worst, (kept[i][s0:s1].transpose(0, 1)[None].float() - ref.float()).abs().max().item())
    return worst


def main():
    import torch

    import fmha_iree

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bhsd_module")
    ap.add_argument("bshd_module")
    ap.add_argument("--device", default="cuda://0")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda", int(args.device.rsplit("/", 1)[-1]))
    batch = fmha_iree.load(args.bhsd_module, device=args.device)
    group = fmha_iree.load(args.bshd_module, device=args.device)
    results = {
        "batch, default stream": _batch_case(batch, torch, dev, torch.cuda.stream(torch.cuda.default_stream(dev)),
                                             args.calls),
        "batch, side stream": _batch_case(batch, torch, dev, torch.cuda.stream(torch.cuda.Stream(dev)), args.calls),
        "group mode": _group_case(group, torch, dev, args.calls),
    }
    ok = True
    for name, worst in results.items():
        print(f"{name:<24} {args.calls} calls, max |diff| vs torch SDPA {worst:.2e}")
        ok &= worst < 2e-2
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
