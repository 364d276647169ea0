#!/usr/bin/env python3
"""Where the GPU time goes, and prototype steps (scripts/gpu_proto.py) against torch, in one run.

    python scripts/gpu_bench.py --module gpu_modules/f16_d128.vmfb --proto gpu_modules/proto

Part 1: the shipped path (runtime.load): end-to-end call, then the same plan replayed by hand with
device-resident inputs: H2D copies, init, every step call, finalize, D2H; and, through
torch.profiler (CUPTI sees IREE's kernels too), a per-kernel table of one step call.
Part 2: each proto_*.vmfb: attn_full / dense_step / causal_step checked against torch (fresh
random inputs, max abs error and rel. Frobenius error) and timed with device-resident inputs.
Torch flash / cuDNN timed in the same process. B=4 H=16 S=4096 D=128 f16, bhsd.
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import numpy as np

B, H, S, D, R = 4, 16, 4096, 128, 64
ONLY: list = []


def wall(fn, sync, reps):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def tflops(t, causal):
    return 4 * B * H * S * S * D / (2 if causal else 1) / t / 1e12


def torch_times(q, k, v):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res = {}
    for causal in (False, True):
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(20):
                        fn()
                    e1.record()
                    torch.cuda.synchronize()
                    res[(name, causal)] = e0.elapsed_time(e1) / 20 / 1e3
            except Exception as e:
                res[(name, causal)] = float("nan")
                print(name, "failed", str(e)[:200])
    return res


def kernel_table(fn, label, top=12):
    """CUPTI kernel times (us) of one call of ``fn`` (IREE's own CUDA launches included)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
        agg = {}
        for e in evs:
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.device_time if hasattr(e, "device_time") else e.cuda_time
        tot = sum(a[1] for a in agg.values())
        print(f"-- kernels of {label}: {len(evs)} device events, {tot / 1e3:.2f} ms device time")
        for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"   {us / 1e3:9.3f} ms  x{n:4d}  {name[:110]}")
    except Exception as e:
        print("profiler failed:", repr(e)[:300])


def part1(path, q, k, v):
    import iree.runtime as rt

    from fmha_iree.api import run_batch  # noqa: F401  (import check)
    from fmha_iree.mask import Mask
    from fmha_iree.plan import Sequences, build_plan, units_budget
    from fmha_iree.runtime import load

    f = load(path, device="cuda://0")
    mod = f.module
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    for causal in (False, True):
        mask = "b" if causal else "0"
        t = wall(lambda: f(qn, kn, vn, mask=mask), lambda: None, 2)
        print(f"[shipped] end-to-end causal={causal}: {t * 1e3:.1f} ms ({tflops(t, causal):.2f} TFLOP/s)")
        # replay by hand
        seqs = Sequences.batch(np.full(B, S), np.full(B, S))
        plan = build_plan(seqs, Mask.from_str(mask), f.tiles, (B, S), (B, S), units_budget(H, f.tiles))
        print(f"   plan: {plan.n_tiles} tiles, {plan.n_units} units, {plan.n_calls} step calls "
              f"(P per call {[len(c) for c in plan.calls[:3]]}...)")
        t0 = time.perf_counter()
        qd, kd, vd = (rt.asdevicearray(mod.device, a) for a in (qn, kn, vn))
        sd = rt.asdevicearray(mod.device, np.array([1 / np.sqrt(D)], np.float32))
        t_h2d = time.perf_counter() - t0
        t0 = time.perf_counter()
        acc, m, l = mod._init(np.zeros((plan.n_tiles, H), np.int32))
        m.to_host()
        t_init = time.perf_counter() - t0
        descs = [rt.asdevicearray(mod.device, c) for c in plan.calls]
        om, lm = rt.asdevicearray(mod.device, plan.out_map), rt.asdevicearray(mod.device, plan.lse_map)
        ts = []
        t0 = time.perf_counter()
        for dsc in descs:
            t1 = time.perf_counter()
            acc, m, l = mod._step(qd, kd, vd, sd, acc, m, l, dsc)
            ts.append(time.perf_counter() - t1)
        l.to_host()
        t_steps = time.perf_counter() - t0
        t0 = time.perf_counter()
        out, lse = mod._finalize(acc, m, l, om, lm)
        lse.to_host()
        t_fin = time.perf_counter() - t0
        t0 = time.perf_counter()
        out.to_host()
        t_d2h = time.perf_counter() - t0
        print(f"   H2D q,k,v {t_h2d * 1e3:.1f} ms | init {t_init * 1e3:.1f} | {len(descs)} steps {t_steps * 1e3:.1f} ms "
              f"(per call median {sorted(ts)[len(ts) // 2] * 1e3:.2f}, max {max(ts) * 1e3:.2f}) | finalize {t_fin * 1e3:.1f} "
              f"| D2H out {t_d2h * 1e3:.1f}")
        if not causal:
            acc, m, l = mod._init(np.zeros((plan.n_tiles, H), np.int32))
            dsc = descs[0]
            kernel_table(lambda: mod._step(qd, kd, vd, sd, acc, m, l, dsc)[2].to_host(), "one step call (unmasked)")
            kernel_table(lambda: mod._finalize(acc, m, l, om, lm)[1].to_host(), "finalize")


def part2(proto_dir, q, k, v, ref):
    import iree.runtime as rt
    import torch

    from fmha_iree.runtime import get_device

    from fmha_iree.targets import resolve_device

    dev = get_device(resolve_device("cuda://0")[0])
    qn, kn, vn = q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy()
    qd, kd, vd = (rt.asdevicearray(dev, a) for a in (qn, kn, vn))
    nt = B * S // R
    omap = (np.arange(B)[:, None] * S + np.arange(S)[None, :]).astype(np.int32)
    omd = rt.asdevicearray(dev, omap)
    carrier = rt.asdevicearray(dev, np.zeros((nt, H), np.int32))
    rows = []
    for path in sorted(glob.glob(os.path.join(proto_dir, "proto_*.vmfb"))):
        name = os.path.basename(path)[6:-5]
        if ONLY and name not in ONLY:
            continue
        ctx = rt.SystemContext(config=rt.Config(device=dev))
        vm = rt.VmModule.copy_buffer(ctx.instance, open(path, "rb").read())
        ctx.add_vm_module(vm)
        mod = ctx.modules[vm.name]
        for fname, causal in (("attn_full", False), ("dense_step", False), ("causal_step", True)):
            try:
                fn = mod[fname]
            except Exception as e:
                print(name, fname, "missing", e)
                continue
            try:
                if fname == "attn_full":
                    run = lambda: fn(qd, kd, vd)  # noqa
                    out = run().to_host()
                    sync = lambda: None  # noqa
                    timed = lambda: fn(qd, kd, vd).to_host() if False else fn(qd, kd, vd)  # noqa
                else:
                    def run(fn=fn):
                        acc, m, l = mod["init"](carrier)
                        acc, m, l = fn(qd, kd, vd, acc, m, l)
                        return mod["finalize"](acc, m, l, omd, omd)
                    out, lse = run()
                    out = out.to_host()

                    def timed(fn=fn):
                        acc, m, l = mod["init"](carrier)
                        return fn(qd, kd, vd, acc, m, l)
                r = ref[causal]
                o = torch.from_numpy(np.asarray(out)).float()
                err = (o - r).abs().max().item()
                rel = ((o - r).norm() / r.norm()).item()
                last = {}

                def go():
                    last["x"] = timed()

                def sync():
                    x = last["x"]
                    (x[2] if isinstance(x, tuple) else x).to_host() if False else None

                # time N calls back to back, one sync at the end
                def block(n=10):
                    res = None
                    for _ in range(n):
                        res = timed()
                    if isinstance(res, tuple):  # calls are synchronous (async-internal); a small read to be sure
                        res[2].to_host()

                t = wall(block, lambda: None, 3) / 10
                # init alone, for subtraction
                tinit = 0.0
                if fname != "attn_full":
                    def iblock(n=10):
                        res = None
                        for _ in range(n):
                            res = mod["init"](carrier)
                        res[2].to_host()
                    tinit = wall(iblock, lambda: None, 3) / 10
                rows.append((name, fname, causal, t, tinit, err, rel))
                print(f"[proto {name}] {fname}: {t * 1e3:.3f} ms (init {tinit * 1e3:.3f}) "
                      f"{tflops(t - tinit, causal):.1f} TFLOP/s  max|err| {err:.2e} rel {rel:.2e}", flush=True)
                if fname != "attn_full":
                    kernel_table(lambda: timed()[2].to_host(), f"{name} {fname}")
            except Exception as e:
                print(f"[proto {name}] {fname} failed: {repr(e)[:400]}", flush=True)
    return rows


def main():
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--module")
    ap.add_argument("--proto")
    ap.add_argument("--only", default="", help="comma list of proto config names")
    ap.add_argument("--flags", default="", help="iree runtime flags, e.g. --cuda_use_streams=false")
    args = ap.parse_args()
    if args.flags:
        import iree.runtime as rt

        rt.flags.parse_flags(*args.flags.split())
        print("runtime flags:", args.flags)
    global ONLY
    ONLY = [x for x in args.only.split(",") if x]
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16, device="cuda") for _ in range(3))
    tt = torch_times(q, k, v)
    for (n, c), t in tt.items():
        print(f"[torch] {n} causal={c}: {t * 1e3:.3f} ms ({tflops(t, c):.0f} TFLOP/s)")
    ref = {}
    with torch.no_grad():
        for c in (False, True):
            # float32 math reference on the GPU (math backend)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                ref[c] = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                          is_causal=c).cpu()
    rows = []
    if args.proto:
        rows = part2(args.proto, q, k, v, ref)
    if args.module:
        part1(args.module, q.cpu(), k.cpu(), v.cpu())
    print("\n== summary (B=4 H=16 S=4096 D=128 f16; device-resident inputs; t includes init/state merge)")
    for name, fname, c, t, ti, err, rel in rows:
        fl = tt[("flash", c)]
        cu = tt[("cudnn", c)]
        print(f"{name:8s} {fname:11s} causal={int(c)} {t * 1e3:7.3f} ms {tflops(t, c):6.1f} TFLOP/s "
              f"x{fl / t:.2f} flash x{cu / t:.2f} cudnn  rel {rel:.1e}")
    for (n, c), t in tt.items():
        print(f"torch {n:5s} causal={int(c)} {t * 1e3:7.3f} ms {tflops(t, c):6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
