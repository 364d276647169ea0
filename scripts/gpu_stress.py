#!/usr/bin/env python3
"""Robustness on a GPU of modules compiled elsewhere: a call that needs more device memory than is
free, then a timed loop of mixed calls that must not leak device memory.

    python scripts/gpu_stress.py BHSD.vmfb BSHD.vmfb [--seconds 30] [--device cuda://0]

BHSD is a batch-mode module (``fmha-iree compile --target sm_80 --dtype f16 --hdim 128
--heads 16:16``), BSHD a ``--layout bshd`` one (``--heads 32:8``) that also serves group mode.

1. torch takes all but 256 MiB of the GPU; a call on a B4 H16 S=16384 problem (~1.3 GiB of results and
   intermediates)
   must raise a ``MemoryError`` naming the device; torch gives the memory back and the same call
   must then work.
2. For ``--seconds``, mixed calls (both modules; batch and group mode; masks; decode, prefill,
   odd lengths; host arrays and DeviceTensors; with and without LSE), every 50th checked against
   a float64 torch reference. Free device memory (``torch.cuda.mem_get_info``, which sees IREE's
   allocations too, read with torch's cache emptied) is printed at seven marks: a leak falls from
   mark to mark, IREE's allocation pools level off once warm.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np


def _ref(q, k, v, mask, layout):
    """float64 reference in ``layout`` for a batch-mode call."""
    import torch

    from fmha_iree import Mask

    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    vis = torch.from_numpy(Mask.from_str(mask).materialize(sq, sk)).to(q.device)
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) / np.sqrt(q.shape[-1])
    o = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0) @ v.double().repeat_interleave(g, 1)
    return o.transpose(1, 2) if layout == "bshd" else o


def out_of_memory(f, device):
    import torch

    import fmha_iree

    x = torch.randn(4, 16, 16384, 128, dtype=torch.float16)  # 256 MiB; out, state and padded Q ~1.3 GiB more
    ins = [fmha_iree.to_device(t, device) for t in (x, x, x)]
    free, total = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")
    print(f"oom: torch holds {hog.numel() / 2**30:.1f} GiB of {total / 2**30:.1f}", flush=True)
    t0 = time.perf_counter()
    try:
        out = f(*ins, mask="b")
        out.wait()
        print("oom: FAIL, the call did not raise", flush=True)
    except MemoryError as e:
        print(f"oom: MemoryError after {time.perf_counter() - t0:.2f} s: {str(e)[:240]}", flush=True)
    except Exception as e:  # noqa: BLE001 - the point is to see what a user would get
        print(f"oom: FAIL, {type(e).__name__}: {str(e)[:300]}", flush=True)
    del hog
    torch.cuda.empty_cache()
    out = f(*ins, mask="b").to_torch()
    print(f"oom: the next call works: {tuple(out.shape)} finite={bool(torch.isfinite(out.float()).all())}",
          flush=True)


def _batch_case(rng, f, layout):
    import torch

    b, hq, hk = rng.choice([(1, 16, 16), (2, 16, 16), (4, 16, 16)]) if layout == "bhsd" else \
        rng.choice([(1, 32, 8), (3, 32, 8)])
    sq, sk = rng.choice([(1, rng.randint(1, 9000)), (rng.randint(1, 700), rng.randint(1, 3000)),
                         (s := rng.randint(64, 2100), s), (2048, 2048)])
    mask = rng.choice(["0", "b", "t", "b:128,0", "t:17,5", "xb:64"])
    shape = (lambda s, h: (b, h, s, 128)) if layout == "bhsd" else (lambda s, h: (b, s, h, 128))
    q = torch.randn(shape(sq, hq), dtype=torch.float16, device="cuda")
    k = torch.randn(shape(sk, hk), dtype=torch.float16, device="cuda")
    v = torch.randn(shape(sk, hk), dtype=torch.float16, device="cuda")
    return (q, k, v), dict(mask=mask), f"{layout} B{b} {sq}x{sk} {mask}"


def _varlen_case(rng):
    """Packed sequences for the bshd module's group mode: (q, k, v, seqstart_q, seqstart_k, mask)."""
    import torch

    n = rng.randint(1, 12)
    lq = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(300, 1500)]) for _ in range(n)]
    lk = [x + rng.choice([0, rng.randint(0, 600)]) for x in lq]
    cum = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    q = torch.randn(max(sum(lq), 1), 32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(max(sum(lk), 1), 8, 128, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    return q, k, v, cum(lq), cum(lk), rng.choice(["0", "b", "t:64,0"])


def _varlen_ref(q, k, v, sq, sk, mask):
    out = torch_zeros_like(q)
    for b in range(len(sq) - 1):
        a, e, c, d = int(sq[b]), int(sq[b + 1]), int(sk[b]), int(sk[b + 1])
        if e > a:
            out[a:e] = _ref(q[a:e][None], k[c:d][None], v[c:d][None], mask, "bshd")[0]
    return out


def torch_zeros_like(x):
    import torch

    return torch.zeros(x.shape, dtype=torch.float64, device=x.device)


def mixed_loop(mods, device, seconds):
    import fmha_iree

    rng = random.Random(0)
    n, worst, marks = 0, 0.0, []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if rng.random() < 0.25:
            q, k, v, sq, sk, mask = _varlen_case(rng)
            out = mods["bshd"].varlen(q.cpu(), k.cpu(), v.cpu(), sq, sk, mask=mask)
            if n % 10 == 0:
                err = (out.cuda().double() - _varlen_ref(q, k, v, sq, sk, mask)).abs().max().item()
                worst = max(worst, err)
                if err > 2e-2:
                    print(f"loop: FAIL varlen q{np.diff(sq).tolist()} mask={mask}: max err {err:.3g}", flush=True)
            n += 1
            continue
        layout = rng.choice(["bhsd", "bshd"])
        f = mods[layout]
        (q, k, v), kw, what = _batch_case(rng, f, layout)
        on_dev = rng.random() < 0.5
        ins = [fmha_iree.to_device(x.cpu(), device) for x in (q, k, v)] if on_dev else [x.cpu() for x in (q, k, v)]
        lse = rng.random() < 0.5
        res = f(*ins, return_lse=lse, **kw)
        out = res[0] if lse else res
        out = out.to_torch() if on_dev else out
        if n % 50 == 0:
            err = (out.cuda().double() - _ref(q, k, v, kw["mask"], layout)).abs().max().item()
            worst = max(worst, err)
            if err > 2e-2:
                print(f"loop: FAIL {what}: max err {err:.3g}", flush=True)
        n += 1
        if time.perf_counter() - t0 > len(marks) * seconds / 6:
            marks.append((n, _free_gib()))
    marks.append((n, _free_gib()))
    print(f"loop: {n} calls in {seconds} s, worst checked error {worst:.2e}", flush=True)
    print("loop: free device memory (GiB, torch's cache emptied) after n calls: "
          + ", ".join(f"{c}: {g:.3f}" for c, g in marks), flush=True)
    print(f"loop: change from the second mark to the end {(marks[-1][1] - marks[1][1]) * 1024:+.1f} MiB", flush=True)


def _free_gib() -> float:
    """Free device memory with torch's own cache handed back (so only IREE's holdings count)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / 2**30


def main():
    from fmha_iree import load

    ap = argparse.ArgumentParser()
    ap.add_argument("bhsd")
    ap.add_argument("bshd")
    ap.add_argument("--device", default="cuda://0")
    ap.add_argument("--seconds", type=float, default=30)
    args = ap.parse_args()
    mods = {"bhsd": load(args.bhsd, device=args.device), "bshd": load(args.bshd, device=args.device)}
    out_of_memory(mods["bhsd"], args.device)
    mixed_loop(mods, args.device, args.seconds)


if __name__ == "__main__":
    main()
