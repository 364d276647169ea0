"""GPU: the group-mode / paged model (one module with fmha_iree's kernel inside, from
docs/bench/model_varlen_export.py sm_80: f16, 16:4 heads of 128, mask b) against a float32 torch
reference, and its time against a deployed module's group / paged calls. From the repository
root, on the GPU machine:
    OUT=DIR python docs/bench/model_varlen_check.py varlen_sm_80.vmfb ATTN.vmfb [--fmha-device]
(ATTN: a bshd f16 d128 G4 module compiled without --heads; --fmha-device: the model on fmha_iree's
device, else on IREE's own, opened first). Writes DIR/varlen.json."""
import json, os, sys
import numpy as np, torch
import iree.runtime as rt
sys.path.insert(0, "scripts")
from _timing import device_time, median_time
import fmha_iree

OUT = os.environ["OUT"]
if "--fmha-device" in sys.argv:
    from fmha_iree.runtime.device import get_device

    dev = get_device("cuda://0")
else:
    dev = rt.get_device("cuda://0")
ctx = rt.SystemContext(config=rt.Config(device=dev))
ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, open(sys.argv[1], "rb").read()))
main = ctx.modules.module["main"]
HQ, HK, D, PAGE = 16, 4, 128, 64
rng = np.random.default_rng(0)

def starts(l): return np.concatenate([[0], np.cumsum(l)]).astype(np.int32)

def ref(q, k, v):  # one sequence, bottom-right causal, float32 on the GPU
    q, k, v = (torch.from_numpy(x).cuda().float() for x in (q, k, v))
    sq, sk = q.shape[0], k.shape[0]
    if sq == 0 or sk == 0:
        return np.zeros((sq, HQ, D), np.float32)
    kk, vv = k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) / D ** 0.5
    vis = torch.arange(sk, device="cuda")[None] <= torch.arange(sq, device="cuda")[:, None] + (sk - sq)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vv).cpu().numpy()

def inputs(lq, lk):
    q = rng.standard_normal((sum(lq), HQ, D)).astype(np.float16)
    k = rng.standard_normal((sum(lk), HK, D)).astype(np.float16)
    v = rng.standard_normal((sum(lk), HK, D)).astype(np.float16)
    npg = [-(-n // PAGE) for n in lk]
    pages = rng.permutation(max(sum(npg), 1)).astype(np.int32)
    bt = np.zeros((len(lk), max(max(npg), 1)), np.int32)
    kc = np.zeros((len(pages), PAGE, HK, D), np.float16); vc = np.zeros_like(kc)
    ks, i = starts(lk), 0
    for b, n in enumerate(npg):
        for j in range(n):
            bt[b, j] = pages[i]; i += 1
            rows = slice(ks[b] + j * PAGE, min(ks[b] + (j + 1) * PAGE, ks[b + 1]))
            kc[bt[b, j], :rows.stop - rows.start] = k[rows]; vc[bt[b, j], :rows.stop - rows.start] = v[rows]
    return q, k, v, starts(lq), starts(lk), kc, vc, np.asarray(lk, np.int32), bt

res = {"device": torch.cuda.get_device_name()}
for name, lq, lk in (("mixed", [1, 30, 0, 7, 200], [40, 130, 5, 0, 300]), ("decode16", [1] * 16, [4096] * 16)):
    args = inputs(lq, lk)
    q, k, v, sq, sk = args[:5]
    outs = [np.asarray(r.to_host(), np.float32) for r in main(*args)]
    err = [0.0, 0.0]
    for b in range(len(lq)):
        r = ref(q[sq[b]:sq[b + 1]], k[sk[b]:sk[b + 1]], v[sk[b]:sk[b + 1]])
        for j, o in ((0, outs[0]), (1, outs[2])):
            err[j] = max(err[j], float(np.abs(o[sq[b]:sq[b + 1]] - r).max()) if r.size else 0.0)
    res[name] = {"max_abs_err_group": err[0], "max_abs_err_paged": err[1]}
    dargs = [rt.asdevicearray(dev, a) for a in args]
    res[name]["model_both_ms"] = median_time(lambda: main(*dargs), 20) * 1e3
    print(name, res[name], flush=True)
mod = fmha_iree.load(sys.argv[2], device="cuda://0")
q, k, v, sq, sk, kc, vc, lk, bt = inputs([1] * 16, [4096] * 16)
up = lambda x: fmha_iree.to_device(x, "cuda://0")
qd, kd, vd, kcd, vcd = map(up, (q, k, v, kc, vc))
res["deployed_group_ms"] = device_time(lambda: mod.varlen(qd, kd, vd, sq, sk), 20) * 1e3
res["deployed_paged_ms"] = device_time(lambda: mod.varlen(qd, kcd, vcd, sq, None, seqlen_k=lk, block_table=bt), 20) * 1e3
print(res, flush=True)
json.dump(res, open(f"{OUT}/varlen{'_fmha' if '--fmha-device' in sys.argv else ''}.json", "w"), indent=1)
