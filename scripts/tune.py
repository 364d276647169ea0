#!/usr/bin/env python3
"""Tune IREE's lowering of ONE whole-problem (unmasked) attention for NVIDIA GPUs (CUDA target).

Three verbs:

    python scripts/tune.py compile --out tune_out [--dtype f16 bf16] [--hdim 64 128 256] [--quick]
                                   [--stage coarse|final] [--from RESULTS.json] [--jobs 2]
    python scripts/tune.py run tune_out --out DIR [--reps 20] [--only NAME,...]
    python scripts/tune.py write RESULTS.json [--out fmha_iree/problem/tuned_cuda.json]

Since 2026-11-30 (commit 30b39b7) ``compile`` builds every module as the package builds CUDA modules,
with IREE's polynomial exp2 replaced by ``ex2.approx`` (``fmha_iree/toolchain/ptx.py``; ``--iree-exp2`` to
keep IREE's). The current ``tuned_cuda.json`` entries were chosen by a sweep of IREE's fused
``attention`` op on the H200 (2026-11-30, commit 30b39b7; docs/BENCHMARKS.md); this
script's ``online_attention`` grid is the 2026-11-29 instrument, and its ``write`` output has the
same format (one entry per dtype and head dim; ``tiles.py`` reads ``workgroup_m``,
``reduction_k2``, ``subgroups_m``).

``compile`` (CPU machine, needs iree-base-compiler and this package) renders, for a grid of
lowering configs, a standalone module

    util.func public @attn(%q, %k, %v : tensor<?xSxDxT>  [BH, S, D], BH dynamic, S fixed per module)
        -> (out tensor<?xSxDxT>, lse tensor<?xSxf32>)

holding one ``iree_linalg_ext.online_attention`` from a fresh state (acc 0, max -3.4e38, sum 0)
and two ``linalg.generic`` (out = acc / sum cast to T; lse = (max + log2(sum)) * ln 2: IREE's
online_attention works in base 2, folding log2(e) into the scale; one 3-D generic with both
results, lse's map (d0, d1) over a 3-D iteration, compiled but ran 10-30x slower and gave NaN). It
compiles every module with ``iree-compile --iree-hal-target-device=cuda --iree-cuda-target=sm_80 --iree-input-type=auto``
plus the config's flags, ``--jobs`` at a time, and writes ``OUT/index.json`` (one entry per module:
name, file, config (the ``render_lowering_attrs`` dict), flags, dtype, d, static shape or None,
compile seconds, or the error for configs that failed). ``--stage coarse`` (default) compiles the
f16 d128 grid; ``--stage final`` compiles the best few configs of a previous ``run`` (``--from``)
for every requested dtype / head dim, plus a static-shape twin of the best f16 d128 config.

``run`` (GPU machine, needs only iree-base-runtime, torch with CUDA, numpy) loads each module on
``cuda://0``, uploads random inputs once as device arrays, warms up, times ``--reps`` calls
back to back (one ``to_host`` of the last result's lse at the end: IREE calls are asynchronous, the
final readback waits for all of them; per-call wall times with a sync each are kept too), checks
the output and lse once against torch SDPA in fp32 math on the GPU, times torch flash and cuDNN
SDPA on the same shapes with CUDA events, and writes ``DIR/results.json`` and ``DIR/results.csv``
after every module (partial results survive a timeout).

``write`` keeps the fastest correct module per (dtype, hdim) at the main shape (S=4096) and
writes them to ``fmha_iree/problem/tuned_cuda.json``.

TFLOP/s = 4 * BH * S * S * D / time.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import datetime as _dt
import json
import math
import sys
import time
from pathlib import Path

from _tune_grid import ROOT, BASE_FLAGS, SHAPES, SHAPE_MODES, SMEM_LIMIT, _compile_one, _top_configs, cfg_name, coarse_grid, make_job, other_dims_cfgs, smem_bytes

def cmd_compile(args):
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    if args.stage == "coarse":
        for cfg in coarse_grid(args.quick):
            jobs.append(make_job(cfg, "f16", 128))
        for dtype in args.dtype:
            for d in args.hdim:
                for cfg in other_dims_cfgs(dtype, d, args.quick):
                    if (dtype, d) != ("f16", 128):
                        jobs.append(make_job(cfg, dtype, d))
                    if args.quick and (dtype, d) != ("f16", 128):
                        continue
                    if not cfg.get("prefetch") and cfg["promote"] == [1, 2]:  # second shape
                        jobs.append(make_job(cfg, dtype, d, "dynbh", 1))
        # the shape modes, once, for the default config
        c0 = {**dict(promote=[1, 2], prefetch=None, qk="nv", pv="nv", flag="none"),
              **dict(wm=64, k2=32, sgm=4, sgn=1)}
        for mode in SHAPE_MODES[1:]:
            jobs.append(make_job(c0, "f16", 128, mode))
    else:
        top = _top_configs(args.from_, args.top)
        print("top configs:", [cfg_name(c) for c in top])
        for dtype in args.dtype:
            for d in args.hdim:
                for cfg in top:
                    c = dict(cfg)
                    if dtype == "bf16" and "wmma" in (c.get("qk"), c.get("pv")):
                        c["qk"] = c["pv"] = "nv"
                    while smem_bytes(c, d) > SMEM_LIMIT and c["k2"] > 16:
                        c["k2"] //= 2
                    for si in range(len(SHAPES[d])):
                        jobs.append(make_job(c, dtype, d, "dynbh", si))
        if top:
            for mode in SHAPE_MODES[1:]:
                jobs.append(make_job(top[0], "f16", 128, mode))
    seen = set()
    jobs = [j for j in jobs if not (j["name"] in seen or seen.add(j["name"]))]
    for j in jobs:
        j["native_exp2"] = not args.iree_exp2
    idx_path = outdir / "index.json"
    index = json.loads(idx_path.read_text()) if (idx_path.exists() and args.append) else []
    done = {e["name"] for e in index}
    jobs = [j for j in jobs if j["name"] not in done]
    print(f"compiling {len(jobs)} modules, {args.jobs} at a time -> {outdir}", flush=True)
    t0 = time.time()
    with cf.ThreadPoolExecutor(args.jobs) as ex:
        futs = [ex.submit(_compile_one, j, outdir) for j in jobs]
        for i, f in enumerate(cf.as_completed(futs), 1):
            e = f.result()
            index.append(e)
            st = "ok" if "file" in e else "FAIL " + e["error"][:160]
            print(f"[{i}/{len(jobs)}] {e['name']}: {st} ({e['compile_s']} s, total {time.time() - t0:.0f} s)",
                  flush=True)
            idx_path.write_text(json.dumps(index, indent=1))
    nf = sum(1 for e in index if "file" not in e)
    print(f"done: {len(index) - nf} compiled, {nf} failed; {idx_path}")


# ----------------------------------------------------------------------------------------------
# run (GPU machine)

def _torch_dtype(dtype):
    import torch
    return {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]


def _cuda_time(fn, reps):
    """Milliseconds per call (torch CUDA events, 3 warm-up calls)."""
    from _timing import cuda_time

    return cuda_time(fn, reps, warmup=3) * 1e3


def _problem(dev, dtype: str, d: int, bh: int, s: int, reps: int):
    """Random q, k, v [BH, S, D] on the IREE device, torch flash / cuDNN times for them, and an
    fp32 reference (out, lse) computed on the GPU: (device arrays, times, reference)."""
    import iree.runtime as rt
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(bh, s, d, dtype=_torch_dtype(dtype), device="cuda", generator=g)
               for _ in range(3))
    hosts = [x.cpu().contiguous() for x in (q, k, v)]
    if dtype == "bf16":
        import ml_dtypes  # iree.runtime needs it anyway
        devs = [rt.asdevicearray(dev, h.view(torch.int16).numpy().view(ml_dtypes.bfloat16)) for h in hosts]
    else:
        devs = [rt.asdevicearray(dev, h.numpy()) for h in hosts]
    # torch baselines on [1, BH, S, D]
    tq, tk, tv = (x.view(1, bh, s, d) for x in (q, k, v))
    tt = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                tt[name] = _cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv),
                                      reps)
        except Exception as ex:  # noqa
            print(f"  torch {name} failed: {str(ex)[:200]}")
            tt[name] = float("nan")
    # fp32 reference (out, lse) on the GPU, chunked over BH to bound memory
    outs, lses = [], []
    with torch.no_grad():
        sc = 1.0 / math.sqrt(d)
        for i in range(0, bh, 8):
            qf, kf, vf = (x[i:i + 8].float() for x in (q, k, v))
            sco = torch.matmul(qf, kf.transpose(-1, -2)) * sc
            lse = torch.logsumexp(sco, dim=-1)
            outs.append(torch.matmul(torch.softmax(sco, -1), vf))
            lses.append(lse)
            del sco
    ref = (torch.cat(outs), torch.cat(lses))
    print(f"  [{dtype} d{d} BH{bh} S{s}] torch flash {tt['flash']:.3f} ms "
          f"({4 * bh * s * s * d / tt['flash'] / 1e9:.0f} TFLOP/s), cudnn {tt['cudnn']:.3f} ms", flush=True)
    return devs, tt, ref


def _time_module(fn, devs, reps: int) -> tuple[float, float]:
    """(ms per call over a block of back-to-back calls with one readback at the end, after a
    warm-up; median seconds of 5 calls with a readback each, an upper bound)."""
    for _ in range(3):
        res = fn(*devs)
    res[1].to_host()
    t0 = time.perf_counter()
    for _ in range(reps):
        res = fn(*devs)
    res[1].to_host()
    t_block = (time.perf_counter() - t0) / reps
    ts = []
    for _ in range(5):
        t1 = time.perf_counter()
        fn(*devs)[1].to_host()
        ts.append(time.perf_counter() - t1)
    return t_block * 1e3, sorted(ts)[len(ts) // 2]


def cmd_run(args):
    import numpy as np
    import torch
    import iree.runtime as rt

    mdir = Path(args.modules)
    index = json.loads((mdir / "index.json").read_text())
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    only = [x for x in (args.only or "").split(",") if x]
    mods = [e for e in index if "file" in e and (not only or e["name"] in only)]
    if args.first:
        first = [x for x in args.first.split(",") if x]
        mods.sort(key=lambda e: (0 if any(f in e["name"] for f in first) else 1))
    dev = rt.get_device("cuda://0")
    cfg = rt.Config(device=dev)
    print("device", torch.cuda.get_device_name(0), "modules", len(mods), flush=True)
    t_start = time.time()
    rows = []
    inputs = {}

    def get_inputs(dtype, d, bh, s):
        key = (dtype, d, bh, s)
        if key not in inputs:
            inputs.clear()  # keep one problem resident
            torch.cuda.empty_cache()
            inputs[key] = _problem(dev, dtype, d, bh, s, args.reps)
        return inputs[key]

    # order: group modules by (dtype, d, shape) to reuse inputs
    work = []
    for e in mods:
        work.append((e["dtype"], e["d"], e["BH"], e["S"], e))
    work.sort(key=lambda w: (w[3] != SHAPES[w[1]][0][1], w[0] != "f16", w[1] != 128, w[0], w[1], w[2], w[3]))
    for i, (dtype, d, bh, s, e) in enumerate(work, 1):
        if args.budget_s and time.time() - t_start > args.budget_s:
            print("time budget reached; stopping", flush=True)
            break
        row = dict(name=e["name"], dtype=dtype, d=d, BH=bh, S=s, mode=e["mode"], config=e["config"],
                   lowering=e["lowering"], flags=e["flags"])
        try:
            devs, tt, ref = get_inputs(dtype, d, bh, s)
            ctx = rt.SystemContext(config=cfg)
            vm = rt.VmModule.copy_buffer(ctx.instance, (mdir / e["file"]).read_bytes())
            ctx.add_vm_module(vm)
            fn = ctx.modules[vm.name]["attn"]
            out, lse = fn(*devs)
            lse.to_host()
            # correctness once
            if dtype == "bf16":
                o = torch.from_numpy(np.asarray(out.to_host()).view(np.int16).copy()).view(torch.bfloat16).float()
            else:
                o = torch.from_numpy(np.asarray(out.to_host())).float()
            lh = torch.from_numpy(np.asarray(lse.to_host()).copy())
            ro, rl = ref
            row["err"] = (o - ro.cpu()).abs().max().item() if o.shape == ro.shape else float("nan")
            row["lse_err"] = (lh - rl.cpu()).abs().max().item() if lh.shape == rl.shape else float("nan")
            ms, t_med = _time_module(fn, devs, args.reps)
            row.update(ok=bool(row["err"] < (0.05 if dtype == "bf16" else 0.01)), ms=ms,
                       ms_sync_median=t_med * 1e3,
                       tflops=4 * bh * s * s * d / (ms * 1e-3) / 1e12,
                       flash_ms=tt["flash"], cudnn_ms=tt["cudnn"],
                       vs_flash=tt["flash"] / ms, vs_cudnn=tt["cudnn"] / ms)
            print(f"[{i}/{len(work)}] {e['name']} BH{bh} S{s}: {ms:.3f} ms ({row['tflops']:.0f} TFLOP/s, "
                  f"x{row['vs_flash']:.2f} flash, x{row['vs_cudnn']:.2f} cudnn, sync-median {t_med * 1e3:.3f}) "
                  f"err {row['err']:.1e} lse {row['lse_err']:.1e}", flush=True)
            del ctx, vm, fn, out, lse
        except Exception as ex:  # noqa
            row.update(ok=False, error=repr(ex)[:400])
            print(f"[{i}/{len(work)}] {e['name']} BH{bh} S{s}: FAILED {repr(ex)[:300]}", flush=True)
        rows.append(row)
        _save(outdir, rows, torch.cuda.get_device_name(0))
    print(f"done in {time.time() - t_start:.0f} s")


def _save(outdir: Path, rows, hw):
    meta = dict(date=_dt.date.today().isoformat(), hardware=hw, command=" ".join(sys.argv), rows=rows)
    (outdir / "results.json").write_text(json.dumps(meta, indent=1))
    keys = ["name", "dtype", "d", "BH", "S", "ms", "tflops", "flash_ms", "cudnn_ms", "vs_flash", "vs_cudnn",
            "err", "lse_err", "ms_sync_median", "ok", "error"]
    with open(outdir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})


# ----------------------------------------------------------------------------------------------
# write

def cmd_write(args):
    res = json.loads(Path(args.results).read_text())
    best = {}
    for r in res["rows"]:
        if not r.get("ok") or r.get("mode", "dynbh") != "dynbh":
            continue
        if r["S"] != SHAPES[r["d"]][0][1]:
            continue
        key = (r["dtype"], r["d"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    entries = []
    for (dtype, d), r in sorted(best.items()):
        target = "sm_80"
        for f in r["flags"]:
            if f.startswith("--iree-cuda-target="):
                target = f.split("=", 1)[1]
        extra = [f for f in r["flags"] if f not in BASE_FLAGS and not f.startswith("--iree-cuda-target=")]
        entries.append(dict(
            target=target, dtype=dtype, hdim=d, lowering=r["lowering"], flags=extra,
            tflops=round(r["tflops"], 1), ms=round(r["ms"], 4), flash_ms=round(r["flash_ms"], 4),
            cudnn_ms=round(r["cudnn_ms"], 4), vs_flash=round(r["vs_flash"], 3),
            date=res.get("date"), hardware=res.get("hardware"),
            shape=dict(BH=r["BH"], S=r["S"], D=d),
            module=r["name"],
            command=res.get("command") or "python scripts/tune.py run <modules> --out <dir>"))
        print(f"{dtype} d{d}: {r['name']} {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s x{r['vs_flash']:.2f} flash")
    out = Path(args.out)
    out.write_text(json.dumps(entries, indent=1) + "\n")
    print("wrote", out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--out", default="tune_out")
    c.add_argument("--dtype", nargs="+", default=["f16"], choices=["f16", "bf16"])
    c.add_argument("--hdim", nargs="+", type=int, default=[128], choices=[64, 128, 256])
    c.add_argument("--quick", action="store_true")
    c.add_argument("--stage", choices=["coarse", "final"], default="coarse")
    c.add_argument("--from", dest="from_", help="results.json of a coarse run (stage final)")
    c.add_argument("--top", type=int, default=3)
    c.add_argument("--jobs", type=int, default=2)
    c.add_argument("--append", action="store_true", help="add to an existing index.json")
    c.add_argument("--iree-exp2", action="store_true",
                   help="keep IREE's polynomial exp2 (default: ex2.approx, as the package's CUDA modules)")
    r = sub.add_parser("run")
    r.add_argument("modules")
    r.add_argument("--out", required=True)
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--only", default="")
    r.add_argument("--first", default="", help="comma list of name substrings to run first")
    r.add_argument("--budget-s", type=float, default=0, help="stop starting modules after this many s")
    w = sub.add_parser("write")
    w.add_argument("results")
    w.add_argument("--out", default=str(ROOT / "fmha_iree" / "tuned_cuda.json"))
    args = ap.parse_args()
    {"compile": cmd_compile, "run": cmd_run, "write": cmd_write}[args.verb](args)


if __name__ == "__main__":
    main()
