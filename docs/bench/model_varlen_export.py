"""The module of docs/bench/model_varlen_check.py: a group-mode and a paged call site of
fmha_fwd_varlen (f16, 16:4 heads of 128, mask b) exported and compiled for TARGET (sm_80, gfx942,
gfx1100, host): python docs/bench/model_varlen_export.py TARGET -> varlen_TARGET.vmfb; prints the
compile times and, for gfx targets, kernels / spills / matrix instructions."""
import sys, time, torch
sys.path.insert(0, "/work/main/tests")
from fmha_iree.integrations.model_export import export_model, compile_model
from fmha_iree.integrations.torch_ops import fmha_fwd_varlen
target = sys.argv[1]
class M(torch.nn.Module):
    def forward(self, q, k, v, sq, sk, kc, vc, lk, bt):
        a = fmha_fwd_varlen(q, k, v, sq, sk, mask="b", return_lse=True)
        b = fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=lk, block_table=bt, mask="b", return_lse=True)
        return (*a, *b)
h = torch.float16
q = torch.randn(10, 16, 128, dtype=h); k = torch.randn(12, 4, 128, dtype=h); v = torch.randn(12, 4, 128, dtype=h)
kc = torch.randn(8, 64, 4, 128, dtype=h); vc = torch.randn(8, 64, 4, 128, dtype=h)
sq = torch.tensor([0, 4, 10], dtype=torch.int32); sk = torch.tensor([0, 5, 12], dtype=torch.int32)
lk = torch.tensor([5, 7], dtype=torch.int32); bt = torch.zeros(2, 3, dtype=torch.int32)
D = lambda n: torch.export.Dim(n, max=1<<16)
dyn = {"q": {0: D("tq")}, "k": {0: D("tk")}, "v": {0: D("tk")}, "sq": {0: D("b1")}, "sk": {0: D("b1")}, "kc": {0: D("p")}, "vc": {0: D("p")}, "lk": {0: D("b")}, "bt": {0: D("b"), 1: D("mp")}}
t0 = time.time()
mlir = export_model(M(), (q, k, v, sq, sk, kc, vc, lk, bt), target=target, dynamic_shapes=dyn)
t1 = time.time()
man = compile_model(mlir, target=target, output=f"varlen_{target}.vmfb")
print(target, "export", round(t1 - t0, 1), "compile", round(time.time() - t1, 1))
isa = man.get("isa")
if isa: print({k: v for k, v in list(isa.items())[:3]} if isinstance(isa, dict) else isa[:3])
if isa:
    att = [k for k in isa if k["kernel"].startswith("fmha_iree_")]
    print(len(isa), len(att), sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in isa), sum(k.get("mfma_count", 0) + k.get("wmma_count", 0) for k in att))
