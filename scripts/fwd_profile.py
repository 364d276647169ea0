#!/usr/bin/env python3
"""Kernel breakdown (torch.profiler, which sees IREE's CUDA kernels) and call time of one call per
case of the `general` bench preset, on CUDA modules compiled elsewhere.

    python scripts/fwd_profile.py [LABEL...]      # LABELs pick cases by substring, e.g. decode chunked

Modules are read from $FMHA_PROFILE_MODULES (default gpu_modules/), compiled on any machine with

    fmha-iree compile --target sm_80 --dtype f16 --hdim 128 --heads 16:16 -o gpu_modules/f16_d128_g1_generic.vmfb
    fmha-iree compile --target sm_80 --dtype f16 --hdim 128 --heads 32:8  -o gpu_modules/f16_d128_g4.vmfb
    fmha-iree compile --target sm_80 --dtype f16 --hdim 128 --heads 16:16 --seqlens 1024,2048,4096,8192 \
        -o gpu_modules/f16_d128_g1.vmfb          # the "compiled" cases only

$FMHA_PROFILE_DEVICE (default cuda://0) picks the device, $TOPK (default 14) how many kernels are
listed per case. Needs iree-base-runtime, numpy and torch with CUDA. The call time is the best of
3 blocks of 10 back-to-back calls on device-resident inputs; the kernel table is the mean over 5
profiled calls (count per call, ms per call, kernel name).
"""
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fmha_iree
from fmha_iree import load

MODULES = os.environ.get("FMHA_PROFILE_MODULES", "gpu_modules")
DEVICE = os.environ.get("FMHA_PROFILE_DEVICE", "cuda://0")
GENERIC, GQA, COMPILED = "f16_d128_g1_generic.vmfb", "f16_d128_g4.vmfb", "f16_d128_g1.vmfb"
CASES = [  # label, module file, B, Hq, Hk, Sq, Sk, mask
    ("causal S4096 fwd", GENERIC, 4, 16, 16, 4096, 4096, "b"),
    ("causal S4096 compiled", COMPILED, 4, 16, 16, 4096, 4096, "b"),
    ("causal S3000 fwd", GENERIC, 4, 16, 16, 3000, 3000, "b"),
    ("unmasked S1000 fwd", GENERIC, 4, 16, 16, 1000, 1000, "0"),
    ("unmasked S1024 fwd", GENERIC, 16, 16, 16, 1024, 1024, "0"),
    ("unmasked S1024 compiled", COMPILED, 16, 16, 16, 1024, 1024, "0"),
    ("decode B16", GQA, 16, 32, 8, 1, 8192, "b"),
    ("decode B1", GQA, 1, 32, 8, 1, 32768, "b"),
    ("chunked", GQA, 4, 32, 8, 512, 4096, "b"),
    ("window fwd", GENERIC, 4, 16, 16, 4096, 4096, "b:1024,0"),
    ("window 4096 S16384 fwd", GENERIC, 1, 16, 16, 16384, 16384, "b:4096,0"),
    ("window 256 S8192 fwd", GENERIC, 2, 16, 16, 8192, 8192, "b:256,0"),
    ("window S3000 fwd", GENERIC, 4, 16, 16, 3000, 3000, "b:1024,0"),
    ("smallest", GENERIC, 1, 16, 16, 128, 128, "0"),
]


def main(sel: list[str]) -> None:
    mods = {}
    for label, name, B, Hq, Hk, Sq, Sk, mask in CASES:
        if sel and not any(s in label for s in sel):
            continue
        mp = os.path.join(MODULES, name)
        if mp not in mods:
            mods[mp] = load(mp, device=DEVICE)
        f = mods[mp]
        torch.manual_seed(0)
        q = torch.randn(B, Hq, Sq, 128, dtype=torch.float16)
        k = torch.randn(B, Hk, Sk, 128, dtype=torch.float16)
        v = torch.randn(B, Hk, Sk, 128, dtype=torch.float16)
        qd, kd, vd = (fmha_iree.to_device(x, DEVICE) for x in (q, k, v))
        for _ in range(3):
            r = f(qd, kd, vd, mask=mask)
        r.wait()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(10):
                r = f(qd, kd, vd, mask=mask)
            r.wait()
            best = min(best, (time.perf_counter() - t0) / 10)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                r = f(qd, kd, vd, mask=mask)
            r.wait()
            torch.cuda.synchronize()
        tot = {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            kname = e.name[:90]
            c, t = tot.get(kname, (0, 0.0))
            tot[kname] = (c + 1, t + e.device_time_total / 1e3)
        ksum = sum(t for c, t in tot.values()) / 5
        launches = sum(c for c, _ in tot.values()) // 5
        print(f"== {label} [{mp}]: call {best * 1e3:.3f} ms, kernels {ksum:.3f} ms/call, {launches} launches/call",
              flush=True)
        for kname, (c, t) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:int(os.environ.get("TOPK", "14"))]:
            print(f"   {c / 5:5.1f}x {t / 5:8.4f} ms  {kname}")


if __name__ == "__main__":
    main(sys.argv[1:])
