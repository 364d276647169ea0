"""What an fp8 KV cache costs on a GPU: decode with K / V in ``float8_e4m3fn`` (per-KV-head
descales) against the same module on f16 K / V, at issue 58's decode rows (B16 and B64, GQA 32:8,
Sk 8192, d128), contiguous and paged (pages of 64 rows in shuffled order), with SDPA (f16, GQA)
measured in the same run. Reports ms, the ratio to the f16 call, and the HBM bandwidth the K / V
bytes imply (fp8: one byte an element). Errors against a float32 reference on the dequantized values.

Module (sm_80, f16, d128, bshd), compiled beforehand into ``--modules``: ``g4_d`` (``--heads 32:8``).

    python scripts/bench_fp8.py --modules DIR [--reps 20] [--out DIR]
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import torch_device_time, write_rows  # noqa: E402

HQ, HK, D, SK, PAGE = 32, 8, 128, 8192, 64


def _paged(k, v):
    """(k_cache, v_cache, block_table, lens): the keys in pages of ``PAGE`` rows, shuffled."""
    import torch

    b, sk, h, d = k.shape
    n = sk // PAGE
    perm = torch.randperm(b * n, generator=torch.Generator().manual_seed(1)).cuda()
    kc, vc = torch.empty(b * n, PAGE, h, d, dtype=k.dtype, device="cuda"), torch.empty(b * n, PAGE, h, d, dtype=v.dtype,
                                                                                          device="cuda")
    kc[perm], vc[perm] = k.reshape(b * n, PAGE, h, d), v.reshape(b * n, PAGE, h, d)
    return kc, vc, perm.view(b, n).to(torch.int32).cpu().numpy(), [sk] * b


def run_row(b: int, mod, reps: int) -> list[dict]:
    import numpy as np
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(b, SK, HK, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    dk = torch.linspace(0.01, 0.02, HK, device="cuda")
    top = torch.finfo(torch.float8_e4m3fn).max  # saturate, as a cache's quantizer does (out of range is NaN)
    k8 = (k.float() / dk.view(1, 1, -1, 1)).clamp(-top, top).to(torch.float8_e4m3fn)
    v8 = (v.float() / 0.02).clamp(-top, top).to(torch.float8_e4m3fn)
    kd, vd = (k8.float() * dk.view(1, 1, -1, 1)).half(), (v8.float() * 0.02).half()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, kd, vd))
    sq = np.arange(b + 1, dtype=np.int32)
    qv = q.reshape(b, HQ, D)
    kc, vc, table, lens = _paged(kd, vd)
    kc8, vc8, _, _ = _paged(k8.view(torch.uint8), v8.view(torch.uint8))
    kc8, vc8 = kc8.view(torch.float8_e4m3fn), vc8.view(torch.float8_e4m3fn)
    calls = {
        "fmha_f16": lambda: mod(q, kd, vd),
        "fmha_fp8": lambda: mod(q, k8, v8, k_descale=dk, v_descale=0.02),
        "sdpa_f16": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
        "fmha_f16_paged": lambda: mod.varlen(qv, kc, vc, sq, None, seqlen_k=lens, block_table=table),
        "fmha_fp8_paged": lambda: mod.varlen(qv, kc8, vc8, sq, None, seqlen_k=lens, block_table=table,
                                             k_descale=dk, v_descale=0.02),
    }
    ref = torch.nn.functional.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True)
    ref = ref.transpose(1, 2)
    rows, times = [], {}
    for key, fn in calls.items():
        try:
            t = torch_device_time(fn, reps)
            out = fn()
            err = float((out.reshape(ref.shape).float() - ref).abs().max())
        except Exception as e:  # noqa: BLE001 (reported, not fatal)
            print(f"B{b} {key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            t, err = None, math.nan
        times[key] = t
        base = times.get("fmha_f16_paged" if key.endswith("_paged") else "fmha_f16")
        nbytes = 2 * b * SK * HK * D * (1 if "fp8" in key else 2)
        row = dict(row=f"B{b}", call=key, ms=None if t is None else t * 1e3,
                   vs_fmha_f16=None if t is None or not base else t / base,
                   kv_gbps=None if t is None else nbytes / t / 1e9, max_abs_err=err)
        print(f"B{b:<3} {key:15} {row['ms'] or math.nan:9.4f} ms  x{row['vs_fmha_f16'] or math.nan:.3f}"
              f"  {row['kv_gbps'] or math.nan:7.1f} GB/s  err {err:.2e}", flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch

    import fmha_iree

    print(torch.cuda.get_device_name(), flush=True)
    mod = fmha_iree.load(Path(a.modules) / "g4_d.vmfb", device="cuda://0")
    rows = []
    for b in (16, 64):
        rows += run_row(b, mod, a.reps)
    if a.out:
        write_rows(Path(a.out), rows)


if __name__ == "__main__":
    main()
