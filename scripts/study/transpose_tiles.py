"""Study at commit 59a747a: tile configs of V's transpose [BH, S, Dv] -> [BH, Dv, S] (the copy the
transpose_v dense path and the V^T block templates start with), one function per config.

  transpose_tiles.py build OUT.vmfb        (here: compiles for sm_80)
  transpose_tiles.py run OUT.vmfb [S]      (on the H200: torch.profiler kernel times, BH=64, Dv=128 f16)
"""
import sys

# (name, workgroup tile over (N, S, Dv), thread tile, workgroup_size, promote)
CONFIGS = [
    ("cur_32x32_t4", [1, 32, 32], [1, 4, 1], [8, 32, 1], True),
    ("32x32_t8", [1, 32, 32], [1, 8, 1], [4, 32, 1], True),
    ("64x64_t8", [1, 64, 64], [1, 8, 1], [8, 64, 1], True),
    ("64x32_t8", [1, 64, 32], [1, 8, 1], [8, 32, 1], True),
    ("32x64_t4", [1, 32, 64], [1, 4, 1], [8, 64, 1], True),
    ("128x32_t8", [1, 128, 32], [1, 8, 1], [16, 32, 1], True),
    ("64x64_t4", [1, 64, 64], [1, 4, 1], [16, 64, 1], True),
    ("32x128_t4", [1, 32, 128], [1, 4, 1], [8, 128, 1], True),
    ("64x128_t8", [1, 64, 128], [1, 8, 1], [8, 128, 1], True),
    ("32x32_t4_noprom", [1, 32, 32], [1, 4, 1], [8, 32, 1], False),
    ("iree_default", None, None, None, False),
]
S, DV = 4096, 128


def func(name, wg, th, ws, promote):
    ty_i, ty_o = f"tensor<?x{S}x{DV}xf16>", f"tensor<?x{DV}x{S}xf16>"
    cfg = ""
    if wg:
        prom = ", promote_operands = [0]" if promote else ""
        cfg = (" attrs = {compilation_info = #iree_codegen.compilation_info<"
               f"lowering_config = #iree_gpu.lowering_config<{{workgroup = {wg}, thread = {th}{prom}}}>, "
               "translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> "
               f"workgroup_size = {ws} subgroup_size = 32>>}}")
    return f"""util.func public @t_{name}(%x: {ty_i}, %s: tensor<1xf32>) -> {ty_o} {{
  %c0 = arith.constant 0 : index
  %zero = arith.constant 0.0 : f32
  %sf = tensor.extract %s[%c0] : tensor<1xf32>
  %z = arith.subf %sf, %sf : f32
  %zt = arith.truncf %z : f32 to f16
  %n = tensor.dim %x, %c0 : {ty_i}
  %e = tensor.empty(%n) : {ty_o}
  %y = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d2, d1)>],
      iterator_types = ["parallel", "parallel", "parallel"]}} ins(%x : {ty_i}) outs(%e : {ty_o}){cfg} {{
  ^bb0(%a: f16, %o: f16):
    %b = arith.addf %a, %zt : f16
    linalg.yield %b : f16
  }} -> {ty_o}
  util.return %y : {ty_o}
}}"""


def build(out):
    import iree.compiler.tools as ict
    flags = ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]
    ok = []
    for c in CONFIGS:
        try:
            ict.compile_str("module @m {\n" + func(*c) + "\n}", extra_args=flags)
            ok.append(c)
            print("ok  ", c[0], flush=True)
        except Exception as e:  # noqa: BLE001
            print("FAIL", c[0], str(e).splitlines()[-1][:200] if str(e) else "", flush=True)
    src = "module @m {\n" + "\n".join(func(*c) for c in ok) + "\n}"
    open(out, "wb").write(ict.compile_str(src, extra_args=flags))


def run(path, s):
    import numpy as np
    import torch
    from torch.profiler import profile, ProfilerActivity
    import iree.runtime as rt
    assert s == S
    cfg = rt.Config("cuda")
    ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, open(path, "rb").read()))
    x = rt.asdevicearray(cfg.device, np.random.rand(64, S, DV).astype(np.float16))
    sc = rt.asdevicearray(cfg.device, np.ones(1, np.float32))
    ref = np.asarray(x.to_host()).transpose(0, 2, 1)
    for name, *_ in CONFIGS:
        fn = getattr(ctx.modules.m, "t_" + name, None)
        if fn is None:
            continue
        y = fn(x, sc)
        good = np.array_equal(np.asarray(y.to_host()), ref)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                y = fn(x, sc)
            y.to_host()
        t = [getattr(e, "device_time_total", 0) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
        ms = sum(t) / 20 / 1e3
        gbs = 2 * 64 * S * DV * 2 / (ms * 1e-3) / 1e9
        print(f"{name:18s} {ms:.4f} ms  {gbs:7.0f} GB/s  exact={good}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        run(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else S)
