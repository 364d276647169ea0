"""Build gpu_diag/<C>/f16_d128.vmfb: the package's f16 d128 sm_80 module (H=16, --seqlens 2048..16384)
with the causal tree's diagonal block fixed by a rule other than compile.causal_diag, to time it
with scripts/bench.py --modules gpu_diag/<C>. Usage: causal_diag_build.py RULE  (RULE: s8 = S/8
capped below at 512; 1024 / 512 / 256 = that C everywhere)."""
import sys
from pathlib import Path

import fmha_iree.compile as C
from fmha_iree.spec import KernelSpec
from fmha_iree.targets import Target
from fmha_iree.tiles import default_tiles

rule = sys.argv[1]
pick = {"s8": lambda s, a: max(512, s // 8), "1024": lambda s, a: 1024 if s > 1024 else s // 2,
        "512": lambda s, a: 512, "256": lambda s, a: 256}[rule]
C.causal_diag = pick
t = Target.from_name("sm_80")
spec = KernelSpec("f16", "bhsd", 1, 128, 128, default_tiles("cuda", 128, 128, "sm_80", "f16"), t,
                  (2048, 4096, 8192, 16384))
out = Path(__file__).resolve().parents[2] / "gpu_diag" / rule / "f16_d128.vmfb"
man = C.build_artifact(spec, out, problem={"heads": 16, "kv_heads": 16, "mask": "0", "lse": False})
print(out, {s: pick(s, 256) for s in spec.seqlens}, man["native_exp2"])
