import subprocess, sys
from fmha_iree.mlir_templates import render_dense, render_lowering_attrs
from fmha_iree.compile import dense_params
from fmha_iree.spec import KernelSpec, check_tiles
from fmha_iree.targets import Target
t = Target.from_name("sm_80")
spec = KernelSpec("f16", "bhsd", 1, 128, 128, check_tiles(None, t, 128, 128, "f16"), t)
low = dense_params(spec)["lowering"]
def fused(S, B, H=16, D=128, scalar=False):
    BH = B * H
    props, attrs = render_lowering_attrs(low, m_total=64, dv=D, c=32)
    ty = f"tensor<{B}x{H}x{S}x{D}xf16>"; t3 = f"tensor<{BH}x{S}x{D}xf16>"
    sc_arg = "%scale: f32" if scalar else "%scale: tensor<1xf32>"
    sc = "" if scalar else "  %c0 = arith.constant 0 : index\n  %scale = tensor.extract %scale_t1[%c0] : tensor<1xf32>\n"
    if not scalar: sc_arg = "%scale_t1: tensor<1xf32>"
    return f"""util.func public @fused_{S}{'_scalar' if scalar else ''}(%q: {ty}, %k: {ty}, %v: {ty}, {sc_arg}) -> {ty} {{
{sc}  %s16 = arith.truncf %scale : f32 to f16
  %q3 = tensor.collapse_shape %q [[0, 1], [2], [3]] : {ty} into {t3}
  %k3 = tensor.collapse_shape %k [[0, 1], [2], [3]] : {ty} into {t3}
  %v3 = tensor.collapse_shape %v [[0, 1], [2], [3]] : {ty} into {t3}
  %e = tensor.empty() : {t3}
  %o = iree_linalg_ext.attention <{{{props}
      indexing_maps = [affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>, affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d2)>,
                       affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d4)>, affine_map<(d0, d1, d2, d3, d4) -> ()>,
                       affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4)>]}}>{attrs}
      ins(%q3, %k3, %v3, %s16 : {t3}, {t3}, {t3}, f16) outs(%e : {t3}) {{
  ^bb0(%x: f32):
    iree_linalg_ext.yield %x : f32
  }} -> {t3}
  %o4 = tensor.expand_shape %o [[0, 1], [2], [3]] output_shape [{B}, {H}, {S}, {D}] : {t3} into {ty}
  util.return %o4 : {ty}
}}
"""
noop = """util.func public @noop(%x: tensor<1xf32>) -> tensor<1xf32> {
  %e = tensor.empty() : tensor<1xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>], iterator_types = ["parallel"]} ins(%x : tensor<1xf32>) outs(%e : tensor<1xf32>) {
  ^bb0(%a: f32, %o: f32):
    %y = arith.addf %a, %a : f32
    linalg.yield %y : f32
  } -> tensor<1xf32>
  util.return %r : tensor<1xf32>
}
"""
kw = dict(dtype="f16", layout="bhsd", group=1, dq=128, dv=128, align=64, lowering=low)
fs = [noop]
for S in (512, 4096):
    B = 16384 // S
    fs += [render_dense(func_name=f"dense_{S}", seqlen=S, **kw), fused(S, B), fused(S, B, scalar=True)]
src = "/work/main/gpu_exp2/ov.mlir"
open(src, "w").write("module @ov {\n" + "\n".join(fs) + "}\n")
r = subprocess.run(["iree-compile", src, "--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80", "--iree-input-type=auto", "-o", "/work/main/gpu_exp2/" + (sys.argv[1] if len(sys.argv) > 1 else "ov.vmfb")] + sys.argv[2:], capture_output=True, text=True)
print(r.returncode, r.stderr[-3000:])
