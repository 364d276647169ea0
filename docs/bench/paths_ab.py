# An experiment driver kept with the figures it produced (docs/BENCHMARKS.md, "Paths with a contract:
# before and after"); not part of the package.
"""Before / after timing of the README summary's GPU rows (one process per tree; run alternately).

python ab.py --tree TREE --modules DIR --out OUT.json [--force-fwd] [--reps 20]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--modules", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--force-fwd", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--explain", action="store_true", help="the tree's route takes group-mode arguments")
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    sys.path.insert(0, str(Path(a.tree) / "scripts"))
    global device_time
    from _timing import device_time  # the bench scripts' own (best of blocks, closed by a wait)
    import torch
    import fmha_iree
    from _varlen_cases import case_data, presets

    if a.force_fwd:  # the aligned dense entry and the compiled-in entries off: fwd takes their rows
        from fmha_iree.paths import compiled_in
        from fmha_iree.paths.base import Refused
        for cls in (type(compiled_in.DENSE), type(compiled_in.COMPILED_IN)):
            cls.plan = lambda self, prob, caps: Refused(("off",))
    dev = "cuda://0"
    M = Path(a.modules)
    mods = {}

    def mod(name):
        if name not in mods:
            mods[name] = fmha_iree.load(M / f"{name}.vmfb", device=dev)
        return mods[name]

    rows = []
    gen = torch.Generator().manual_seed(0)

    def batch(label, name, B, hq, hk, sq, sk, mask, lse=False):
        if a.only and not any(o in label for o in a.only):
            return
        f = mod(name)
        q = torch.randn(B, hq, sq, 128, generator=gen).half()
        k = torch.randn(B, hk, sk, 128, generator=gen).half()
        v = torch.randn(B, hk, sk, 128, generator=gen).half()
        qd, kd, vd = (fmha_iree.to_device(x, dev) for x in (q, k, v))
        r = f.route(qd, kd, vd, mask=mask, **({"return_lse": lse} if a.explain else {}))
        t = device_time(lambda: f(qd, kd, vd, mask=mask, return_lse=lse), a.reps)
        rows.append(dict(label=label, ms=t * 1e3, path=r.path, entry=r.entry))
        print(f"{label:<40} {t * 1e3:8.3f} ms  {r.path}:{r.entry}", flush=True)

    batch("causal S=4096", "f16_d128_g1_generic", 4, 16, 16, 4096, 4096, "b")
    batch("causal S=3000", "f16_d128_g1_generic", 4, 16, 16, 3000, 3000, "b")
    batch("unmasked S=1000", "f16_d128_g1_generic", 4, 16, 16, 1000, 1000, "0")
    batch("decode B16 Sk8192", "f16_d128_g4", 16, 32, 8, 1, 8192, "b")
    batch("decode B1 Sk32768", "f16_d128_g4", 1, 32, 8, 1, 32768, "b")
    batch("chunked prefill Sq512 Sk4096", "f16_d128_g4", 4, 32, 8, 512, 4096, "b")
    batch("window b:1024,0 S=4096", "f16_d128_g1_generic", 4, 16, 16, 4096, 4096, "b:1024,0")
    batch("window b:1024,0 S=4096 compiled-in", "f16_d128_g1", 4, 16, 16, 4096, 4096, "b:1024,0")
    batch("smallest call S=128", "f16_d128_g1_generic", 1, 16, 16, 128, 128, "0")
    for s in (1024, 2048, 4096, 8192):
        for m in ("0", "b"):
            batch(f"square S={s} {m} compiled-in", "f16_d128_g1", 16384 // s, 16, 16, s, s, m)
            batch(f"square S={s} {m} generic", "f16_d128_g1_generic", 16384 // s, 16, 16, s, s, m)
        batch(f"square S={s} b compiled-in, with LSE", "f16_d128_g1", 16384 // s, 16, 16, s, s, "b", lse=True)

    for c in presets("gpu"):
        label = c["label"]
        if c["mode"] == "growing" or (a.only and not any(o in label for o in a.only)):
            continue
        name = "f16_d128_g1_bshd" if c["Hq"] == c["Hk"] else "f16_d128_g4_bshd"
        f = mod(name)
        d = case_data(c, 0)
        sq = np.concatenate([[0], np.cumsum(c["q_lens"])]).astype(np.int32)
        sk = np.concatenate([[0], np.cumsum(c["k_lens"])]).astype(np.int32)
        up = lambda x: fmha_iree.to_device(x, dev)  # noqa: E731
        if c["mode"] == "cu_seqlen":
            B, mq, mk = len(c["q_lens"]), max(c["q_lens"]), max(c["k_lens"])
            qb = torch.zeros(B, mq, c["Hq"], 128, dtype=torch.float16)
            kb = torch.zeros(B, mk, c["Hk"], 128, dtype=torch.float16)
            vb = torch.zeros(B, mk, c["Hk"], 128, dtype=torch.float16)
            for b in range(B):
                qb[b, :c["q_lens"][b]] = d["q"][sq[b]:sq[b + 1]]
                kb[b, :c["k_lens"][b]] = d["k"][sk[b]:sk[b + 1]]
                vb[b, :c["k_lens"][b]] = d["v"][sk[b]:sk[b + 1]]
            qd, kd, vd = up(qb), up(kb), up(vb)
            kw = dict(cu_seqlen_q=sq, cu_seqlen_k=sk, mask=c["mask"])
            r = f.route(qd, kd, vd, **kw)
            fn = lambda: f(qd, kd, vd, **kw)  # noqa: E731
        elif c["paged"]:
            qd, kc, vc = up(d["q"]), up(d["k_cache"]), up(d["v_cache"])
            lens = np.array(c["k_lens"], np.int32)
            kw = dict(seqlen_k=lens, block_table=d["block_table"], mask=c["mask"])
            r = f.route(qd, kc, vc, seqstart_q=sq, **kw) if a.explain else None
            fn = lambda: f.varlen(qd, kc, vc, sq, None, **kw)  # noqa: E731
        else:
            qd, kd, vd = up(d["q"]), up(d["k"]), up(d["v"])
            r = f.route(qd, kd, vd, seqstart_q=sq, seqstart_k=sk, mask=c["mask"]) if a.explain else None
            fn = lambda: f.varlen(qd, kd, vd, sq, sk, mask=c["mask"])  # noqa: E731
        t = device_time(fn, a.reps)
        path = (r.path, r.entry) if r is not None else (None, None)
        rows.append(dict(label=label, ms=t * 1e3, path=path[0], entry=path[1]))
        print(f"{label:<40} {t * 1e3:8.3f} ms  {path[0]}:{path[1]}", flush=True)
    Path(a.out).write_text(json.dumps(dict(tree=a.tree, force_fwd=a.force_fwd, device=torch.cuda.get_device_name(0),
                                           rows=rows), indent=1))


if __name__ == "__main__":
    main()
