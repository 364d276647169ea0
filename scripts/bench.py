#!/usr/bin/env python3
"""fmha_iree against torch SDPA, same inputs, same process: time, TFLOP/s, ratios, agreement.

CPU (compiles as needed; --specialize: modules fixed to each shape, compiled in the warm-up):
    python scripts/bench.py --device local-task --preset cpu [--specialize]
GPU with modules compiled elsewhere (`fmha-iree compile --target sm_80 --seqlens ...` into one
folder; only iree-base-runtime, numpy and torch needed on the GPU machine):
    python scripts/bench.py --device cuda://0 --modules gpu_modules --preset fa

Shapes (`--preset fa`) follow the FlashAttention benchmark: B*S = 16k tokens, Hq*D = 2048,
S in 512..16k, D in {64, 128, 256}, causal and not; plus GQA (Hq/Hk = 8) and a `b:1024,0` window.
FLOPs are 4*B*Hq*Sq*Sk*D times the visible fraction of query-key pairs (counted row by row from
the mask's coordinates). Writes a table to stdout and, with --out, a JSON, a CSV and (when matplotlib is installed) a
PNG. On a GPU, both sides are device-resident: fmha_iree gets its inputs as DeviceTensors (uploaded
once, `fmha_iree.to_device`) and leaves its results on the device; `--reps` calls are issued back to
back (asynchronously) and the time is their total over `--reps`, closed by a wait for the last
result. The timed call returns the output only, as torch's SDPA does; the time with the LSE as well
is recorded beside it. Torch is timed with CUDA events. IREE's runtime flags come from
$IREE_PY_RUNTIME_FLAGS (read by `iree.runtime` at import), e.g. `--cuda_use_streams=false` for CUDA
graphs; a run prints and records them. """

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from _timing import cuda_time, device_time, host_time, median_time, torch_device_time, write_rows


def _row(B, Hq, Hk, Sq, D, mask="0", dtype="f16", Sk=None, label="", modules="any", flex=True):
    """``modules`` (with --modules): "seqlens" takes a module with compiled-in lengths, "generic"
    one without, "any" the first that fits; ``flex``: also time FlexAttention (masked rows)."""
    return dict(B=B, Hq=Hq, Hk=Hk, Sq=Sq, Sk=Sq if Sk is None else Sk, D=D, mask=mask, dtype=dtype, label=label,
                modules=modules, flex=flex)


def presets(name):
    """Rows of a run: batch, heads, lengths, head dim, CK mask string, dtype."""
    if name == "cpu":
        return [_row(1, 8, 8, s, 64, m, "f32") for s in (1024, 4096) for m in ("0", "b")]
    if name == "cpu-general":
        # the CPU rows of the issue "One fast path for every batch-mode problem"
        return [_row(4, 32, 8, 1, 64, "b", "f32", Sk=4096, label="decode"),
                _row(1, 8, 8, 256, 64, "b", "f32", Sk=2048, label="chunked prefill"),
                _row(1, 8, 8, 1000, 64, "b", "f32", label="S=1000 causal"),
                *(_row(1, 8, 8, s, 64, m, "f32", label="generic") for s in (1024, 4096) for m in ("0", "b")),
                # batches through the tile plan (its state in blocks since 2026-12-04)
                *(_row(b, 8, 8, 2048, 64, "b", "f32", label="batch") for b in (8, 16))]
    if name == "general":
        # the H200 table of that issue, then the square rows (unmasked and causal, f16 and bf16)
        g, c = "generic", "seqlens"
        rows = [_row(4, 16, 16, 4096, 128, "b", label="causal compiled-in", modules=c),
                _row(4, 16, 16, 4096, 128, "b", label="causal S=4096", modules=g),
                _row(4, 16, 16, 3000, 128, "b", label="causal S=3000", modules=g),
                _row(4, 16, 16, 1000, 128, "0", label="unmasked S=1000", modules=g),
                _row(16, 32, 8, 1, 128, "b", Sk=8192, label="decode B16 Sk8192", modules=g),
                _row(1, 32, 8, 1, 128, "b", Sk=32768, label="decode B1 Sk32768", modules=g),
                _row(4, 32, 8, 512, 128, "b", Sk=4096, label="chunked prefill", modules=g),
                _row(4, 16, 16, 4096, 128, "b:1024,0", label="window", modules=g),
                _row(4, 16, 16, 4096, 128, "b:1024,0", label="window compiled-in", modules=c),
                _row(1, 16, 16, 128, 128, "0", label="smallest call", modules=g)]
        for dt in ("f16", "bf16"):
            for s in (1024, 2048, 4096, 8192):
                for m in ("0", "b"):
                    rows.append(_row(16384 // s, 16, 16, s, 128, m, dt, label="square", modules=c, flex=False))
        return rows
    if name == "windows":
        # sliding windows through `fwd` (runtime lengths): the row, lengths that are no
        # multiple of the key page, a long sequence under a wide window, a narrow one, a chunk
        return [_row(4, 16, 16, 4096, 128, "b:1024,0", label="window", modules="generic"),
                _row(4, 16, 16, 3000, 128, "b:1024,0", label="window S=3000", modules="generic"),
                _row(1, 16, 16, 16384, 128, "b:4096,0", label="window 4096 S=16384", modules="generic"),
                _row(2, 16, 16, 8192, 128, "b:256,0", label="window 256 S=8192", modules="generic"),
                _row(4, 16, 16, 512, 128, "b:1024,0", Sk=4096, label="window chunk Sq512 Sk4096", modules="generic")]
    if name == "heads":
        # head dims without tiles of their own: fwd runs them zero-padded (96 -> 128, 192 -> 256)
        return [_row(b, h, h, s, d, m, label=f"d{d}", modules="generic", flex=False)
                for d, h in ((96, 16), (192, 16)) for b, s, m in ((4, 4096, "b"), (4, 1000, "0"), (16, 1024, "0"))]
    rows = []
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for m in ("0", "b"):
                rows.append(_row(16384 // s, 2048 // d, 2048 // d, s, d, m))
    for s in (512, 1024, 2048, 4096, 8192, 16384):
        for m in ("0", "b"):
            rows.append(_row(16384 // s, 16, 16, s, 128, m, "bf16"))
    rows.append(_row(4, 16, 2, 4096, 128, "b"))
    rows.append(_row(4, 16, 16, 4096, 128, "b:1024,0"))
    return rows


def _peer_mask(mask: str, sq: int, sk: int):
    """How torch's SDPA takes a CK mask: (is_causal, boolean attn_mask or None)."""
    from fmha_iree.problem.mask import Mask

    m = Mask.from_str(mask)
    vis = m.materialize(sq, sk)
    if vis.all():
        return False, None
    if sq == sk and (vis == np.tril(np.ones((sq, sk), bool))).all():
        return True, None
    return False, vis


def _torch_peers(q, k, v, mask, reps, cuda, flex=True):
    """Every torch SDPA backend that takes the case (and, on CUDA, FlexAttention with a BlockMask
    for masked rows), on the same inputs: ({name: seconds or None}, reference output)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sq, sk = q.shape[2], k.shape[2]
    causal, vis = _peer_mask(mask, sq, sk)
    attn_mask = torch.from_numpy(vis).to(q.device) if vis is not None else None
    gqa = q.shape[1] != k.shape[1]
    if cuda:
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}
    else:
        backends = {"default": None, "math": SDPBackend.MATH}
    res, out = {}, None
    for name, be in backends.items():
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)
        try:
            ctx = sdpa_kernel(be) if be is not None else None
            if ctx:
                ctx.__enter__()
            try:
                o = fn()
                res[name] = cuda_time(fn, reps, warmup=0) if cuda else median_time(fn, reps)
                out = o if out is None else out
            finally:
                if ctx:
                    ctx.__exit__(None, None, None)
        except Exception as e:  # a backend this torch / device lacks for the shape
            res[name] = None
            print(f"  torch {name}: {str(e).splitlines()[0][:90]}")
    if cuda and flex and (causal or vis is not None):
        res["flex"] = _flex_time(q, k, v, mask, reps)
    return res, out


def _flex_time(q, k, v, mask, reps):
    """FlexAttention (torch.compile) with a BlockMask of the CK mask: fully masked blocks skipped."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from fmha_iree.problem.mask import Mask

        sq, sk = q.shape[2], k.shape[2]
        y, x = Mask.from_str(mask).clipped_coords(sq, sk)

        def visible(b, h, qi, kj):
            return (kj >= qi - y + 1) & (kj < qi + x)

        bm = create_block_mask(visible, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=q.device)
        flex = torch.compile(flex_attention)
        fn = lambda: flex(q, k, v, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])  # noqa: E731
        fn()
        return cuda_time(fn, reps, warmup=1)
    except Exception as e:  # torch build without Triton, or a shape flex refuses
        print(f"  torch flex: {str(e).splitlines()[0][:90]}")
        return None


def run(args):
    import torch

    import fmha_iree
    from fmha_iree.problem.mask import Mask

    cuda = args.device.startswith("cuda")
    loaded = {}
    rows = []
    for p in presets(args.preset):
        if args.max_seqlen and max(p["Sq"], p["Sk"]) > args.max_seqlen:
            continue
        if (args.hdim and p["D"] not in args.hdim) or (args.dtype and p["dtype"] not in args.dtype):
            continue
        if args.mask != "all" and (p["mask"] != ("b" if args.mask == "causal" else "0")):
            continue
        if args.label and not any(w in p["label"] for w in args.label):
            continue
        dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[p["dtype"]]
        torch.manual_seed(0)
        q = torch.randn(p["B"], p["Hq"], p["Sq"], p["D"], dtype=dt)
        k = torch.randn(p["B"], p["Hk"], p["Sk"], p["D"], dtype=dt)
        v = torch.randn(p["B"], p["Hk"], p["Sk"], p["D"], dtype=dt)
        mask = p["mask"]
        if args.modules:
            key = (p["dtype"], p["D"], p["Hq"] // p["Hk"], p["modules"])
            if key not in loaded:
                from fmha_iree import load

                def fits(m):  # the rows' tensors are bhsd
                    lens = bool((m["capabilities"].get("dense") or {}).get("seqlens"))
                    pr = m["problem"]
                    return ((pr["dtype"], pr["hdim"], pr["group"]) == key[:3] and pr.get("layout", "bhsd") == "bhsd"
                            and (p["modules"] == "any" or lens == (p["modules"] == "seqlens")))

                match = sorted(f for f in Path(args.modules).glob("*.json") if fits(json.loads(f.read_text())))
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
            t = device_time(call, args.reps)
            t_lse = device_time(lambda: f(qd, kd, vd, mask=mask, return_lse=True), args.reps)
            host = host_time(call, args.reps)
            out = call().to_torch()
            t_torch = _torch_inputs_time(f, q, k, v, mask, args.reps, out) if args.torch_inputs else None
        else:
            call = lambda: f(q, k, v, mask=mask)  # noqa
            t = median_time(call, args.reps)
            t_lse = host = t_torch = None
            out = call()
        dev = "cuda" if cuda else "cpu"
        peers, ref = _torch_peers(q.to(dev), k.to(dev), v.to(dev), mask, args.reps, cuda, flex=p["flex"])
        err = (out.float() - ref.float().cpu()).abs().max().item() if ref is not None else float("nan")
        visible = Mask.from_str(mask).visible_pairs(p["Sq"], p["Sk"]) / (p["Sq"] * p["Sk"])
        flops = 4 * p["B"] * p["Hq"] * p["Sq"] * p["Sk"] * p["D"] * visible
        kv_bytes = 2 * p["B"] * p["Hk"] * p["Sk"] * p["D"] * q.element_size()
        row = {**p, "fmha_iree_ms": t * 1e3, "fmha_iree_tflops": flops / t / 1e12, "kv_gb_per_s": kv_bytes / t / 1e9,
               "max_abs_diff": err, "fmha_iree_lse_ms": t_lse * 1e3 if t_lse else None,
               "host_issue_ms": host * 1e3 if host else None,
               "fmha_iree_torch_inputs_ms": t_torch * 1e3 if t_torch else None,
               "fmha_iree_torch_inputs_vs_device_tensors": t / t_torch if t_torch else None}
        best = min((pt for pt in peers.values() if pt), default=None)
        row["ratio_vs_best"] = best / t if best else None
        for name, pt in peers.items():
            row[f"torch_{name}_ms"] = pt * 1e3 if pt else None
            row[f"ratio_vs_{name}"] = pt / t if pt else None
        rows.append(row)
        peer_txt = "  ".join(f"{n} {row[f'torch_{n}_ms']:.3f} ms ({row[f'ratio_vs_{n}']:.2f}x)" for n in peers if row[f"torch_{n}_ms"])
        print(f"{p['label']:<18} B={p['B']:<3} H={p['Hq']}/{p['Hk']:<3} {p['Sq']}x{p['Sk']:<6} D={p['D']} {p['dtype']} "
              f"mask={mask:<9} fmha_iree {t * 1e3:8.3f} ms {row['fmha_iree_tflops']:6.1f} TFLOP/s {row['kv_gb_per_s']:6.0f} GB/s"
              + (f" (lse {t_lse * 1e3:.3f}, host {host * 1e3:.3f} ms)" if t_lse else "")
              + (f" (torch CUDA tensors {t_torch * 1e3:.3f} ms, {t / t_torch:.2f}x)" if t_torch else "")
              + f" | {peer_txt} | best {row['ratio_vs_best'] or 0:.2f}x | diff {err:.1e}", flush=True)
    return rows


def _torch_inputs_time(f, q, k, v, mask, reps: int, want) -> float:
    """Seconds per call of ``f`` on torch CUDA tensors (shared with IREE through DLPack, results
    returned as torch CUDA tensors, the two streams ordered as ``fmha_iree.runtime.torch_gpu`` says), back
    to back, each block closed by ``torch.cuda.synchronize()``; the result must equal ``want``."""
    import torch

    qc, kc, vc = (x.cuda() for x in (q, k, v))
    out = f(qc, kc, vc, mask=mask)
    if not (isinstance(out, torch.Tensor) and out.is_cuda and torch.equal(out.cpu(), want)):
        raise RuntimeError("fmha_iree on torch CUDA tensors: the result is not the DeviceTensor call's")
    return torch_device_time(lambda: f(qc, kc, vc, mask=mask), reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--modules", help="folder of precompiled modules (GPU deployment path)")
    ap.add_argument("--preset", choices=("cpu", "cpu-general", "fa", "general", "heads", "windows"), default="cpu")
    ap.add_argument("--max-seqlen", type=int, default=0)
    ap.add_argument("--hdim", type=int, nargs="*", help="only these head dims")
    ap.add_argument("--dtype", nargs="*", help="only these dtypes (f16, bf16, f32)")
    ap.add_argument("--mask", choices=("all", "none", "causal"), default="all", help="only unmasked / causal rows")
    ap.add_argument("--label", nargs="*", help="only rows whose label contains one of these words")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch-inputs", action="store_true",
                    help="on CUDA, also time each row with torch CUDA tensors passed as they are (issue 17)")
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
        write_rows(args.out, rows)
        out = Path(args.out)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 4))
            labels = [f"{r['Sq']}x{r['Sk']} D{r['D']} {r['mask']}" for r in rows]
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
