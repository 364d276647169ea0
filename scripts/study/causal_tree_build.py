"""Build gpu_vt/<RULE>[_novt]/<dtype>_d128[_g<G>].vmfb: the package's sm_80 module (--seqlens
2048..16384) with the causal tree's diagonal block C fixed by RULE (256 / 512) and its V^T blocks
forced on, or off with `novt`, to time with scripts/bench.py --modules gpu_vt/<dir> --mask causal.
Commit 90e71e0 (docs/bench/h200_2026-11-30d_causal_*). Usage: causal_tree_build.py RULE DTYPE HQ:HK [novt]"""
import functools
import sys
from pathlib import Path

import fmha_iree.compile as C
import fmha_iree.mlir_templates as MT
from fmha_iree.spec import KernelSpec
from fmha_iree.targets import Target
from fmha_iree.tiles import default_tiles

rule, dtype, heads = sys.argv[1], sys.argv[2], sys.argv[3]
vt = not (len(sys.argv) > 4 and sys.argv[4] == "novt")
hq, hk = map(int, heads.split(":"))
C.causal_diag = {"256": lambda s, a: 256, "512": lambda s, a: 512}[rule]
MT.render_causal_tree = functools.partial(MT.render_causal_tree, vt=vt)
t = Target.from_name("sm_80")
spec = KernelSpec(dtype, "bhsd", hq // hk, 128, 128, default_tiles("cuda", 128, 128, "sm_80", dtype), t,
                  (2048, 4096, 8192, 16384))
name = f"{dtype}_d128" + ("" if hq == hk else f"_g{hq // hk}")
out = Path(__file__).resolve().parents[2] / "gpu_vt" / (rule + ("" if vt else "_novt")) / f"{name}.vmfb"
out.parent.mkdir(parents=True, exist_ok=True)
C.build_artifact(spec, out, problem={"heads": hq, "kv_heads": hk, "mask": "0", "lse": False})
print(out)
