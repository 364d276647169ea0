"""Does a serving process slow down with age? Our window and group-mode calls on DeviceTensors,
timed fresh, after torch.compile'd FlexAttention peers ran beside them, then with Python's GC
frozen / disabled, then after torch's caches are emptied. ``--iree-first``: IREE's own CUDA device
(``iree.runtime.get_device``, IREE's default flags) opened before fmha_iree's.

python docs/bench/age.py --modules DIR [--iree-first]   (DIR: f16_d128_g1_generic.vmfb and
f16_d128_g1_bshd.vmfb from fmha-iree compile --target sm_80 --dtype f16 --hdim 128 [--layout bshd])
"""
import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np


def host_issue(fn, reps=20):
    def wait(res):
        last = res[-1] if isinstance(res, tuple) else res
        if hasattr(last, "wait"):
            last.wait()
    wait(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = fn()
        ts.append(time.perf_counter() - t0)
        wait(res)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", required=True)
    ap.add_argument("--tree", default=".")
    ap.add_argument("--iree-first", action="store_true")
    a = ap.parse_args()
    if a.iree_first:
        import iree.runtime as rt

        rt.get_device("cuda://0")
    sys.path.insert(0, a.tree)
    sys.path.insert(0, str(Path(a.tree) / "scripts"))
    import torch
    import fmha_iree
    from _varlen_cases import case_data, presets

    global device_time
    from _timing import device_time  # the bench scripts' own (best of blocks, closed by a wait)

    dev = "cuda://0"
    M = Path(a.modules)
    g1 = fmha_iree.load(M / "f16_d128_g1_generic.vmfb", device=dev)
    vb = fmha_iree.load(M / "f16_d128_g1_bshd.vmfb", device=dev)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (fmha_iree.to_device(torch.randn(4, 16, 4096, 128, generator=gen).half(), dev) for _ in range(3))
    c = presets("gpu")[0]
    d = case_data(c, 0)
    sq = np.concatenate([[0], np.cumsum(c["q_lens"])]).astype(np.int32)
    gq, gk, gv = (fmha_iree.to_device(d[n], dev) for n in "qkv")
    calls = {"window": lambda: g1(q, k, v, mask="b:1024,0"),
             "group prefill": lambda: vb.varlen(gq, gk, gv, sq, sq, mask="b")}

    def report(stage):
        for name, fn in calls.items():
            t, h = device_time(fn, 20), host_issue(fn)
            print(f"{stage:<28} {name:<14} {t * 1e3:7.3f} ms/call, host issue {h * 1e3:6.3f} ms; gc counts "
                  f"{gc.get_count()}, tracked {len(gc.get_objects())}", flush=True)

    report("fresh")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    for s, w in ((1024, 256), (2048, 512), (4096, 1024), (3000, 1024), (4096, 0)):
        qt = torch.randn(4, 16, s, 128, device="cuda", dtype=torch.float16)
        if w:
            bm = create_block_mask(lambda b, h, i, j, w=w: (j <= i) & (i - j <= w), 4, 16, s, s, device="cuda")
        else:
            bm = create_block_mask(lambda b, h, i, j: j <= i, 4, 16, s, s, device="cuda")
        for _ in range(3):
            flex(qt, qt, qt, block_mask=bm)
        flex(qt, qt, qt, score_mod=lambda sc, b, h, i, j: sc + (i - j) * 0.01)
    torch.cuda.synchronize()
    report("after flex peers")
    gc.collect()
    report("after gc.collect")
    gc.freeze()
    report("gc.freeze")
    gc.unfreeze()
    gc.disable()
    report("gc.disable")
    gc.enable()
    torch.cuda.empty_cache()
    report("torch empty_cache")


if __name__ == "__main__":
    main()
