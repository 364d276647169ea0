import sys, json, math
sys.path.insert(0, "/work/main")
from fmha_iree.mlir_templates import render_lowering_attrs
MMA = {"f16": "NV_MMA_SYNC_F32_16x8x16_F16", "bf16": "NV_MMA_SYNC_F32_16x8x16_BF16"}

def module(cfg, dtype="f16", d=128, bh=64, s=4096):
    t = dtype
    vt = bool(cfg and cfg.get("vt"))
    if cfg is None:
        props, attrs = "", ""
    else:
        lw = {"workgroup_m": cfg["wm"], "workgroup_n": d, "reduction_k2": cfg["k2"],
              "promote_operands": cfg.get("promote", [1, 2]), "subgroup_size": 32,
              "subgroups_m": cfg["sgm"], "subgroups_n": cfg.get("sgn", 1),
              "workgroup_size": 32 * cfg["sgm"] * cfg.get("sgn", 1),
              "mma_kind": MMA[dtype], "qk_mma_kind": MMA[dtype]}
        if cfg.get("pf"): lw["prefetch_stages"] = cfg["pf"]
        props, attrs = render_lowering_attrs(lw, m_total=s, dv=d, c=s)
    qt = f"tensor<{bh}x{s}x{d}x{t}>"
    vty, vname, vmap, vtxt = qt, "%v", "(d0, d3, d4)", ""
    if vt:
        vty, vname, vmap = f"tensor<{bh}x{d}x{s}x{t}>", "%vt", "(d0, d4, d3)"
        vtxt = (f"  %vte = tensor.empty() : {vty}\n"
                f"  %vt0 = linalg.transpose ins(%v : {qt}) outs(%vte : {vty}) permutation = [0, 2, 1]\n"
                f"  %vt = util.optimization_barrier %vt0 : {vty}\n")
    return f"""module {{
util.func public @attn(%q: {qt}, %k: {qt}, %v: {qt}) -> {qt} {{
  %scale = arith.constant {1/math.sqrt(d):.9e} : {t}
{vtxt}  %oe = tensor.empty() : {qt}
  %o = iree_linalg_ext.attention <{{{props}
      indexing_maps = [
        affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>,
        affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d2)>,
        affine_map<(d0, d1, d2, d3, d4) -> {vmap}>,
        affine_map<(d0, d1, d2, d3, d4) -> ()>,
        affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4)>]}}>{attrs}
      ins(%q, %k, {vname}, %scale : {qt}, {qt}, {vty}, {t}) outs(%oe : {qt}) {{
  ^bb0(%sc: f32):
    iree_linalg_ext.yield %sc : f32
  }} -> {qt}
  util.return %o : {qt}
}}
}}
"""
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1]) if sys.argv[1] != "none" else None
    print(module(cfg))
