#!/usr/bin/env python3
"""Run modules compiled elsewhere (``fmha-iree compile --target sm_80``) on a CUDA GPU through
``fmha_iree.runtime.load`` (only iree-base-runtime, numpy and torch needed there): check against
torch SDPA on the same GPU in float64-checked fashion, and time both in the same run.

    python scripts/gpu_check.py gpu_modules/f16_d128.vmfb --device cuda://0

Times of fmha_iree include the host<->device copies of the runtime path (inputs are numpy arrays).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main():
    import torch

    from fmha_iree.runtime import load

    ap = argparse.ArgumentParser()
    ap.add_argument("module")
    ap.add_argument("--device", default="cuda://0")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    f = load(args.module, device=args.device)
    print("module", f.manifest["module"], "tiles", f.manifest["tiles"]["ck"])
    torch.manual_seed(0)
    cases = [(2, 16, 77, 130, "b"), (1, 16, 300, 300, "t"), (1, 16, 1000, 1000, None), (1, 16, 513, 700, "b:64,0")]
    for B, H, sq, sk, mask in cases:
        q = torch.randn(B, H, sq, 128, dtype=torch.float16)
        k = torch.randn(B, H, sk, 128, dtype=torch.float16)
        v = torch.randn(B, H, sk, 128, dtype=torch.float16)
        out, lse = f(q.numpy(), k.numpy(), v.numpy(), mask=mask if mask else "0", return_lse=True)
        from fmha_iree import Mask

        vis = torch.from_numpy(Mask.from_str(mask or "0").materialize(sq, sk))
        s = (q.double() @ k.double().transpose(-1, -2)) / np.sqrt(128)
        s = s.masked_fill(~vis, float("-inf"))
        ref = torch.softmax(s, -1).nan_to_num(0) @ v.double()
        rl = torch.logsumexp(s, -1)
        err = (torch.from_numpy(out).double() - ref).abs().max().item()
        lerr = (torch.from_numpy(lse).double() - rl).nan_to_num(0, 0, 0).abs().max().item()
        print(f"check B={B} H={H} Sq={sq} Sk={sk} mask={mask}: max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e}")

    for B, S, causal in ((4, 4096, False), (4, 4096, True), (2, 8192, False), (2, 8192, True)):
        H = 16
        q, k, v = (torch.randn(B, H, S, 128, dtype=torch.float16) for _ in range(3))
        qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
        mask = "b" if causal else "0"
        f(qn, kn, vn, mask=mask)
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            f(qn, kn, vn, mask=mask)
            ts.append(time.perf_counter() - t0)
        t = sorted(ts)[len(ts) // 2]
        qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
        res = {}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)  # noqa
                    fn()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(10):
                        fn()
                    e1.record()
                    torch.cuda.synchronize()
                    res[name] = e0.elapsed_time(e1) / 10 / 1e3
            except Exception as e:  # a backend torch lacks here
                res[name] = float("nan")
                print(name, "failed:", str(e)[:100])
        flops = 4 * B * H * S * S * 128 / (2 if causal else 1)
        print(f"time B={B} H={H} S={S} causal={causal}: fmha_iree {t*1e3:.2f} ms ({flops/t/1e12:.1f} TFLOP/s incl. host copies); "
              + ", ".join(f"torch {n} {x*1e3:.3f} ms ({flops/x/1e12:.0f} TFLOP/s)" for n, x in res.items()))


if __name__ == "__main__":
    main()
