"""GPU experiment: static-S dense/causal entry points and the causal tree vs the dynamic ones."""
import sys, time, json, os
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import numpy as np, torch, iree.runtime as rt
from fmha_iree.runtime import get_device, DeviceTensor
from _timing import cuda_time
from torch.nn.attention import sdpa_kernel, SDPBackend
URI = "cuda://0"; A = 64; H = 16; D = 128; REPS = 10
dev = get_device(URI)
rows = []
for S in [int(x) for x in sys.argv[1:]]:
    B = 16384 // S
    ctx = rt.SystemContext(config=rt.Config(device=dev))
    vmfb = open(os.path.join(os.path.dirname(__file__), f"exp_{S}.vmfb"), "rb").read()
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    mod = ctx.modules["exp"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16) for _ in range(3))
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    ref = {}
    tt = {}
    for causal in (False, True):
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(be):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
                o = fn()
                tt[(causal, name)] = cuda_time(fn, REPS)
                if name == "flash":
                    ref[causal] = o.float().cpu()
    ins = [DeviceTensor.from_host(x.numpy().reshape(B, H, S // A, A, D), "f16", URI).buffer_view() for x in (q, k, v)]
    sc = np.array([D ** -0.5], np.float32)
    names = ["dense_dyn", "dense_st", "causal_dyn", "causal_r2_st", "causal_r4_st"] + [f"tree_{c}" for c in (256, 512, 1024, 2048) if c < S]
    for fn_name in names:
        causal = not fn_name.startswith("dense")
        try:
            f = mod[fn_name]
            o, l = f(*ins, sc)
            out = torch.from_numpy(np.asarray(o.to_host()).astype(np.float32)).reshape(B, H, S, D)
            err = (out - ref[causal]).abs().max().item()
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(REPS):
                    o, l = f(*ins, sc)
                l.to_host()
                best = min(best, (time.perf_counter() - t0) / REPS)
        except Exception as e:
            print(S, fn_name, "FAILED", str(e)[:300]); continue
        fl = 4 * B * H * S * S * D / (2 if causal else 1)
        r = dict(S=S, B=B, fn=fn_name, causal=causal, ms=best * 1e3, tflops=fl / best / 1e12, err=err,
                 flash_ms=tt[(causal, "flash")] * 1e3, cudnn_ms=tt[(causal, "cudnn")] * 1e3)
        r["vs_flash"] = r["flash_ms"] / r["ms"]; r["vs_cudnn"] = r["cudnn_ms"] / r["ms"]
        rows.append(r)
        print("S=%5d B=%2d %-14s %7.3f ms %6.1f TF/s err %.1e | flash %.3f (%.2fx) cudnn %.3f (%.2fx)" % (
            S, B, fn_name, r["ms"], r["tflops"], err, r["flash_ms"], r["vs_flash"], r["cudnn_ms"], r["vs_cudnn"]), flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(os.path.join(out, "exp.json"), "w"), indent=1)
