"""Per-call overhead on the GPU: sync vs async-external invocation, scale upload, fused attention op."""
import os, time, sys
import numpy as np, iree.runtime as rt, torch
HERE = os.path.dirname(os.path.abspath(__file__)); OUT = os.environ.get("OUT", "/tmp")
URI = "cuda://0"; H, D, A = 16, 128, 64
dev = rt.get_device(URI)
def load(name):
    ctx = rt.SystemContext(config=rt.Config(device=dev))
    vm = rt.VmModule.copy_buffer(ctx.instance, open(f"{HERE}/{name}", "rb").read())
    ctx.add_vm_module(vm)
    return ctx, vm
def up(a):
    return rt.asdevicearray(dev, a)._buffer_view
def per_call(call, sync, reps=10):
    r = call(); sync(r)
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = call()
        sync(r)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3
ctx, vm = load("ov.vmfb"); m = ctx.modules["ov"]
x = np.array([1.0], np.float32); xd = up(x)
print("noop numpy in : %.3f ms" % per_call(lambda: m["noop"](x), lambda r: r.to_host(), 50))
print("noop device in: %.3f ms" % per_call(lambda: m["noop"](xd), lambda r: r.to_host(), 50))
torch.manual_seed(0)
for S in (512, 4096):
    B = 16384 // S
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda()).float().cpu()
    t5 = [up(t.numpy().reshape(B, H, S // A, A, D)) for t in (q, k, v)]
    t4 = [up(t.numpy()) for t in (q, k, v)]
    sc = np.array([D ** -0.5], np.float32); scd = up(sc)
    f = m[f"dense_{S}"]
    print(S, "dense numpy scale : %.3f ms" % per_call(lambda: f(*t5, sc), lambda r: r[1].to_host()))
    print(S, "dense device scale: %.3f ms" % per_call(lambda: f(*t5, scd), lambda r: r[1].to_host()))
    f = m[f"fused_{S}"]
    o = torch.from_numpy(np.asarray(f(*t4, scd).to_host()).astype(np.float32))
    print(S, "fused err %.1e" % (o - ref).abs().max().item())
    print(S, "fused device scale: %.3f ms" % per_call(lambda: f(*t4, scd), lambda r: r.to_host()))
    f = m[f"fused_{S}_scalar"]
    print(S, "fused scalar      : %.3f ms" % per_call(lambda: f(*t4, D ** -0.5), lambda r: r.to_host()))
# async-external: chained invocations, no host wait between calls
actx, avm = load("ov_async.vmfb")
sem = dev.create_semaphore(0); tp = [0]
def acall(name, ins, nres):
    fn = avm.lookup_function(name)
    args = rt.VmVariantList(len(ins) + 2)
    for a in ins:
        if isinstance(a, float): args.push_float(a)
        else: args.push_ref(a)
    args.push_ref(rt.HalFence(1))
    tp[0] += 1
    sig = rt.HalFence.create_at(sem, tp[0]); args.push_ref(sig)
    rets = rt.VmVariantList(nres)
    actx.vm_context.invoke(fn, args, rets)
    return sig, rets
for S in (512, 4096):
    B = 16384 // S
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda()).float().cpu()
    t5 = [up(t.numpy().reshape(B, H, S // A, A, D)) for t in (q, k, v)]
    t4 = [up(t.numpy()) for t in (q, k, v)]
    scd = up(np.array([D ** -0.5], np.float32))
    sig, rets = acall(f"dense_{S}", t5 + [scd], 2); sig.wait()
    o = torch.from_numpy(np.asarray(rt.DeviceArray(dev, rets.get_as_object(0, rt.HalBufferView)).to_host()).astype(np.float32)).reshape(B, H, S, D)
    print(S, "async dense err %.1e" % (o - ref).abs().max().item())
    print(S, "async dense       : %.3f ms" % per_call(lambda: acall(f"dense_{S}", t5 + [scd], 2), lambda r: r[0].wait()))
    print(S, "async fused scalar: %.3f ms" % per_call(lambda: acall(f"fused_{S}_scalar", t4 + [D ** -0.5], 1), lambda r: r[0].wait()))
    print(S, "async fused 30 reps: %.3f ms" % per_call(lambda: acall(f"fused_{S}_scalar", t4 + [D ** -0.5], 1), lambda r: r[0].wait(), 30))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            r = acall(f"dense_{S}", t5 + [scd], 2)
        r[0].wait()
    prof.export_chrome_trace(f"{OUT}/async_dense_{S}.json")
