"""H200: torch.profiler kernel breakdown of one causal call (and the unmasked one) through the
package on gpu_modules/f16_d128.vmfb (or $FMHA_PROFILE_MODULE), B*S = 16k, H=16, D=128 f16.
$FMHA_PROFILE_MASKS (commit 90e71e0): other masks, separated by ";" (default "0;b"; each causal-like mask
is also timed with the LSE); $FMHA_PROFILE_KV_HEADS: K/V heads (default 16, GQA below);
$FMHA_PROFILE_DTYPE (commit 59a747a): bf16 for a bf16 module.
Usage: causal_profile.py [S...]"""
import os, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
import fmha_iree
from fmha_iree.runtime import load

mod = load(os.environ.get("FMHA_PROFILE_MODULE", "gpu_modules/f16_d128.vmfb"), device="cuda://0")
for S in [int(s) for s in sys.argv[1:]] or [4096, 16384]:
    B = 16384 // S
    torch.manual_seed(0)
    hk = int(os.environ.get("FMHA_PROFILE_KV_HEADS", "16"))
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("FMHA_PROFILE_DTYPE", "f16")]
    q, k, v = (fmha_iree.to_device(torch.randn(B, h, S, 128, dtype=dt), "cuda://0") for h in (16, hk, hk))
    masks = os.environ.get("FMHA_PROFILE_MASKS", "0;b").split(";")
    for mask, lse in [(m, x) for m in masks for x in ((False,) if m == "0" else (False, True))]:
        call = lambda: mod(q, k, v, mask=mask, return_lse=lse)  # noqa
        last = lambda r: (r[-1] if isinstance(r, tuple) else r).wait()  # noqa
        last(call()); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(5):
                r = call()
            last(r)
            wall = (time.perf_counter() - t0) / 5 * 1e3
        tot, spans = {}, []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = getattr(e, "device_time_total", None) or e.cuda_time_total
                c, s = tot.get(e.name[:90], (0, 0.0))
                tot[e.name[:90]] = (c + 1, s + t / 1e3)
                spans.append((e.time_range.start, e.time_range.end))
        ks = sum(s for _, s in tot.values()) / 5
        # commit 533343d: GPU idle between consecutive kernels (first to last kernel of the 5 calls)
        spans.sort()
        idle = sum(max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:])) / 5 / 1e3
        print(f"== S={S} B={B} mask={mask} lse={lse}: wall {wall:.3f} ms/call, kernels {ks:.3f} ms/call, "
              f"idle between kernels {idle:.3f} ms/call", flush=True)
        for name, (c, s) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
            print(f"   {c // 5:3d}x {s / 5:8.3f} ms  {name}")
