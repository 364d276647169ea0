"""Build gpu_tv/<dtype>_d<D>.vmfb: the package's sm_80 module (B*S = 16k convention, --seqlens
512..16384) with ``transpose_v`` forced on in its lowering (V copied to [BH, Dv, S] for the fused
op, the causal tree's levels copying V as [.., Dv, L]), to time against gpu_modules/ with
scripts/bench.py --modules gpu_tv. Usage: transpose_v_build.py DTYPE HDIM HEADS  (HEADS: 16:16)."""
import sys
from pathlib import Path

import fmha_iree.compile as C
import fmha_iree.tiles as T
from fmha_iree.spec import KernelSpec
from fmha_iree.targets import Target
from fmha_iree.tiles import default_tiles

dtype, d, heads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
hq, hk = (int(x) for x in heads.split(":"))
tuned = T.tuned_lowering
T.tuned_lowering = lambda *a: {**tuned(*a), "transpose_v": True}
t = Target.from_name("sm_80")
spec = KernelSpec(dtype, "bhsd", hq // hk, d, d, default_tiles("cuda", d, d, "sm_80", dtype), t,
                  (512, 1024, 2048, 4096, 8192, 16384))
name = f"{dtype}_d{d}" + ("" if hq == hk else f"_g{hq // hk}")
out = Path(__file__).resolve().parents[2] / "gpu_tv" / f"{name}.vmfb"
man = C.build_artifact(spec, out, problem={"heads": hq, "kv_heads": hk, "mask": "0", "lse": False})
print(out, man["native_exp2"])
