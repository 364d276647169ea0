"""Study at commit 533343d (H200): is a call's host side the limit? Per call of the package on a module
($FMHA_PROFILE_MODULE, default gpu_modules/f16_d128.vmfb; $FMHA_PROFILE_DTYPE f16/bf16), B*S = 16k,
H=16, D=128, out only, device-resident inputs: the host time to issue N back-to-back calls (the
calls return once queued; a call waits only for a workspace slot, FmhaModule.WORKSPACE_SLOTS) and
the time until the last result is ready, unmasked and causal; $FMHA_WS_SLOTS overrides the slots.
$FMHA_PROFILE_HDIM (default 128; Hq = 2048 / D), $FMHA_PROFILE_KV_HEADS (default Hq) and
$FMHA_PROFILE_MASKS ("0;b") as in causal_profile.py: the "done" column is the 20-call timing of the
GQA rows in docs/BENCHMARKS.md (commit 533343d; those ran from an inline copy of this loop).
Usage: host_rate.py [S...]"""
import os, sys, time
import torch
import fmha_iree
from fmha_iree.runtime import FmhaModule, load

if os.environ.get("FMHA_WS_SLOTS"):
    FmhaModule.WORKSPACE_SLOTS = int(os.environ["FMHA_WS_SLOTS"])
mod = load(os.environ.get("FMHA_PROFILE_MODULE", "gpu_modules/f16_d128.vmfb"), device="cuda://0")
dt = {"f16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("FMHA_PROFILE_DTYPE", "f16")]
print("IREE_PY_RUNTIME_FLAGS", os.environ.get("IREE_PY_RUNTIME_FLAGS", ""), "slots", FmhaModule.WORKSPACE_SLOTS)
N = 20
for S in [int(s) for s in sys.argv[1:]] or [2048, 4096]:
    B = 16384 // S
    D = int(os.environ.get("FMHA_PROFILE_HDIM", "128"))
    hq = 2048 // D
    hk = int(os.environ.get("FMHA_PROFILE_KV_HEADS", str(hq)))
    q, k, v = (fmha_iree.to_device(torch.randn(B, h, S, D, dtype=dt), "cuda://0") for h in (hq, hk, hk))
    for mask in os.environ.get("FMHA_PROFILE_MASKS", "0;b").split(";"):
        call = lambda: mod(q, k, v, mask=mask)  # noqa
        call().wait()
        best = None
        for _ in range(3):
            ts = []
            t0 = time.perf_counter()
            for _ in range(N):
                r = call()
                ts.append(time.perf_counter())
            t_issue = ts[-1] - t0
            r.wait()
            t_all = time.perf_counter() - t0
            first = ts[0] - t0
            if best is None or t_all < best[1]:
                best = (t_issue, t_all, first)
        print(f"S={S} mask={mask}: issue {best[0] / N * 1e3:.3f} ms/call (first call {best[2] * 1e3:.3f} ms), "
              f"done {best[1] / N * 1e3:.3f} ms/call over {N} calls", flush=True)
