#!/usr/bin/env python3
"""fmha_iree against torch SDPA, same inputs, same process: time, TFLOP/s, ratios, agreement.

CPU (compiles as needed; --specialize: modules fixed to each shape, compiled in the warm-up):
    python scripts/bench.py --device local-task --preset cpu [--specialize]
GPU with modules compiled elsewhere (`fmha-iree compile --target sm_80 --seqlens ...` into one
folder; only iree-base-runtime, numpy and torch needed on the GPU machine):
    python scripts/bench.py --device cuda://0 --modules gpu_modules --preset fa

Shapes (`--preset fa`) follow the FlashAttention benchmark: B*S = 16k tokens, Hq*D = 2048,
S in 512..16k, D in {64, 128, 256}, causal and not; plus GQA (Hq/Hk = 8) and a `b:1024,0` window.
FLOPs are 4*B*Hq*Sq*Sk*D, halved for causal. Writes a table to stdout and, with --out, a JSON, a
CSV and (when matplotlib is installed) a PNG. On a GPU, both sides are device-resident: fmha_iree
gets its inputs as DeviceTensors (uploaded once, `fmha_iree.to_device`) and leaves its results on
the device; `--reps` calls are issued back to back (asynchronously) and the time is their total
over `--reps`, closed by a wait for the last result. The timed call returns the output only, as
torch's SDPA does; the time with the LSE as well is recorded beside it. Torch is timed with CUDA
events. IREE's runtime flags come from $IREE_PY_RUNTIME_FLAGS (read by `iree.runtime` at import),
e.g. `--cuda_use_streams=false` for CUDA graphs; a run prints and records them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from _timing import cuda_time, median_time


def presets(name):
    if name == "cpu":
        return [dict(B=1, Hq=8, Hk=8, S=s, D=64, causal=c, mask=None, dtype="f32") for s in (1024, 4096) for c in (False, True)]
    rows = []
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for c in (False, True):
                rows.append(dict(B=16384 // s, Hq=2048 // d, Hk=2048 // d, S=s, D=d, causal=c, mask=None, dtype="f16"))
    for s in (512, 1024, 2048, 4096, 8192, 16384):
        for c in (False, True):
            rows.append(dict(B=16384 // s, Hq=16, Hk=16, S=s, D=128, causal=c, mask=None, dtype="bf16"))
    rows.append(dict(B=4, Hq=16, Hk=2, S=4096, D=128, causal=True, mask=None, dtype="f16"))
    rows.append(dict(B=4, Hq=16, Hk=16, S=4096, D=128, causal=False, mask="b:1024,0", dtype="f16"))
    return rows


def _torch_peers(q, k, v, causal, attn_mask, reps, cuda):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    backends = {"math": SDPBackend.MATH}
    if cuda:
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}
    else:
        backends = {"default": None, "math": SDPBackend.MATH}
    res, out = {}, None
    for name, be in backends.items():
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)  # noqa
        try:
            ctx = sdpa_kernel(be) if be is not None else None
            if ctx:
                ctx.__enter__()
            try:
                if cuda:
                    o = fn()
                    res[name] = cuda_time(fn, reps, warmup=0)
                else:
                    o = fn()
                    res[name] = median_time(fn, reps)
                out = o if out is None else out
            finally:
                if ctx:
                    ctx.__exit__(None, None, None)
        except Exception as e:  # a backend this torch / device lacks for the shape
            res[name] = None
            print(f"  torch {name}: {str(e).splitlines()[0][:90]}")
    return res, out


def _device_time(call, reps):
    """Seconds per call of ``reps`` back-to-back calls on device-resident data (best of 3 blocks),
    closed by a wait for the last result (GPU modules run asynchronously)."""
    def last(res):
        return (res[-1] if isinstance(res, tuple) else res).wait()

    last(call())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            res = call()
        last(res)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def run(args):
    import torch

    import fmha_iree
    from fmha_iree.mask import Mask

    cuda = args.device.startswith("cuda")
    loaded = {}
    rows = []
    for p in presets(args.preset):
        if args.max_seqlen and p["S"] > args.max_seqlen:
            continue
        if (args.hdim and p["D"] not in args.hdim) or (args.dtype and p["dtype"] not in args.dtype):
            continue
        if args.mask != "all" and (p["mask"] is not None or p["causal"] != (args.mask == "causal")):
            continue
        dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[p["dtype"]]
        torch.manual_seed(0)
        q = torch.randn(p["B"], p["Hq"], p["S"], p["D"], dtype=dt)
        k = torch.randn(p["B"], p["Hk"], p["S"], p["D"], dtype=dt)
        v = torch.randn(p["B"], p["Hk"], p["S"], p["D"], dtype=dt)
        mask = "b" if p["causal"] else (p["mask"] or "0")
        if args.modules:
            key = (p["dtype"], p["D"], p["Hq"] // p["Hk"])
            if key not in loaded:
                from fmha_iree.runtime import load

                match = [f for f in Path(args.modules).glob("*.json")
                         if (lambda m: (m["problem"]["dtype"], m["problem"]["hdim"], m["problem"]["group"]) == key)(json.loads(f.read_text()))]
                if not match:
                    print(f"skip {p}: no module for {key} in {args.modules}")
                    continue
                loaded[key] = load(match[0].with_suffix(".vmfb"), device=args.device)
            f = loaded[key]
        else:
            f = lambda *a, **kw: fmha_iree.fmha_fwd(*a, device=args.device, specialize=args.specialize, **kw)  # noqa
        if cuda:
            qd, kd, vd = (fmha_iree.to_device(x, args.device) for x in (q, k, v))
            # timed like torch's SDPA: the output only; with the LSE as well in fmha_iree_lse_ms
            call = lambda: f(qd, kd, vd, mask=mask)  # noqa
            t = _device_time(call, args.reps)
            t_lse = _device_time(lambda: f(qd, kd, vd, mask=mask, return_lse=True), args.reps)
            out = call().to_torch()
        else:
            call = lambda: f(q, k, v, mask=mask)  # noqa
            t = median_time(call, args.reps)
            t_lse = None
            out = call()
        attn_mask = None
        if p["mask"]:
            attn_mask = torch.from_numpy(Mask.from_str(p["mask"]).materialize(p["S"], p["S"]))
        dev = "cuda" if cuda else "cpu"
        peers, ref = _torch_peers(q.to(dev), k.to(dev), v.to(dev), p["causal"],
                                  attn_mask.to(dev) if attn_mask is not None else None, args.reps, cuda)
        err = (out.float() - ref.float().cpu()).abs().max().item() if ref is not None else float("nan")
        visible = Mask.from_str(mask).materialize(min(p["S"], 2048), min(p["S"], 2048)).mean() if mask != "0" else 1.0
        flops = 4 * p["B"] * p["Hq"] * p["S"] * p["S"] * p["D"] * (0.5 if p["causal"] else visible)
        row = {**p, "fmha_iree_ms": t * 1e3, "fmha_iree_tflops": flops / t / 1e12, "max_abs_diff": err,
               "fmha_iree_lse_ms": t_lse * 1e3 if t_lse else None}
        for name, pt in peers.items():
            row[f"torch_{name}_ms"] = pt * 1e3 if pt else None
            row[f"ratio_vs_{name}"] = pt / t if pt else None
        rows.append(row)
        peer_txt = "  ".join(f"{n} {row[f'torch_{n}_ms']:.2f} ms ({row[f'ratio_vs_{n}']:.2f}x)" for n in peers if row[f"torch_{n}_ms"])
        print(f"B={p['B']:<3} Hq={p['Hq']:<3} Hk={p['Hk']:<3} S={p['S']:<6} D={p['D']:<4} {p['dtype']} mask={mask:<9}"
              f" fmha_iree {t * 1e3:9.2f} ms {row['fmha_iree_tflops']:7.2f} TFLOP/s"
              + (f" (with lse {t_lse * 1e3:.2f} ms)" if t_lse else "") + f" | {peer_txt} | diff {err:.1e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--modules", help="folder of precompiled modules (GPU deployment path)")
    ap.add_argument("--preset", choices=("cpu", "fa"), default="cpu")
    ap.add_argument("--max-seqlen", type=int, default=0)
    ap.add_argument("--hdim", type=int, nargs="*", help="only these head dims")
    ap.add_argument("--dtype", nargs="*", help="only these dtypes (f16, bf16, f32)")
    ap.add_argument("--mask", choices=("all", "none", "causal"), default="all", help="only unmasked / causal rows")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--specialize", action="store_true",
                    help="fmha_fwd(..., specialize=True): modules fixed to each shape (compiled in the warm-up)")
    ap.add_argument("--out", help="folder for bench.json, bench.csv, bench.png")
    args = ap.parse_args()
    # IREE's process-wide runtime flags (e.g. --cuda_use_streams=false: CUDA graphs) change the
    # timings, so a run records them
    flags = os.environ.get("IREE_PY_RUNTIME_FLAGS", "")
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} device={args.device} preset={args.preset}"
          + (f" IREE_PY_RUNTIME_FLAGS={flags!r}" if flags else ""))
    rows = run(args)
    if flags:
        for r in rows:
            r["iree_runtime_flags"] = flags
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(rows, indent=2))
        keys = sorted({k for r in rows for k in r})
        with open(out / "bench.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 4))
            labels = [f"S{r['S']} D{r['D']}{' c' if r['causal'] else ''}" for r in rows]
            ax.bar(np.arange(len(rows)) - 0.2, [r["fmha_iree_tflops"] for r in rows], 0.4, label="fmha_iree")
            peer = next((k for k in rows[0] if k.startswith("torch_") and k.endswith("_ms")), None) if rows else None
            if peer:
                ax.bar(np.arange(len(rows)) + 0.2,
                       [r["fmha_iree_tflops"] / (r[peer.replace("torch_", "ratio_vs_").replace("_ms", "")] or np.inf) for r in rows],
                       0.4, label=peer.replace("_ms", ""))
            ax.set_xticks(np.arange(len(rows)), labels, rotation=90, fontsize=6)
            ax.set_ylabel("TFLOP/s")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "bench.png", dpi=120)
        except ImportError:
            print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
