"""Group mode and a paged KV cache inside an exported model: a torch model calling
``torch.ops.fmha_iree.fmha_fwd_varlen`` (packed sequences with ``seqstart``s as tensors, padded
starts, ``seqlen_k``, a block table) exported with iree-turbine, compiled as one module and run
through ``iree.runtime`` alone, against the float64 reference; a sequence's result bitwise the
same alone and in any batch, and between calls; refusals before iree-compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import assert_close, varlen_ref

import iree.runtime as rt
from fmha_iree.integrations.model_export import compile_model, export_model
from fmha_iree.integrations.torch_ops import fmha_fwd_varlen

MASKS = ["0", "t", "b", "t:5,3", "b:4,0", "xt:7", "xb:9"]
HQ, HK, D, DV = 4, 2, 64, 32


def _dims(names_axes: dict) -> dict:
    """dynamic_shapes with every named axis its own torch.export Dim."""
    return {n: {a: torch.export.Dim(f"{n}_{a}", max=1 << 16) for a in axes} for n, axes in names_axes.items()}


def _module(model, args, dyn, tmp_path, name="model"):
    mlir = export_model(model, args, target="host", dynamic_shapes=_dims(dyn))
    compile_model(mlir, target="host", output=tmp_path / f"{name}.vmfb")
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, (tmp_path / f"{name}.vmfb").read_bytes()))
    fn = ctx.modules.module["main"]

    def run(*arrays):
        res = fn(*(a.numpy() if isinstance(a, torch.Tensor) else a for a in arrays))
        return [np.asarray(r.to_host()) for r in res]

    return run


def _starts(lengths, gaps=None) -> torch.Tensor:
    steps = np.asarray(lengths) + (np.asarray(gaps) if gaps is not None else 0)
    return torch.from_numpy(np.concatenate([[0], np.cumsum(steps)]).astype(np.int32))


def _packed(seed, tq, tk, dtype=torch.float32, hq=HQ, hk=HK):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, hq, D, generator=g).to(dtype), torch.randn(tk, hk, D, generator=g).to(dtype),
            torch.randn(tk, hk, DV, generator=g).to(dtype))


class Group(torch.nn.Module):
    """Every CK mask kind in group mode: each call site's out and LSE."""

    def forward(self, q, k, v, sq, sk):
        res = []
        for m in MASKS:
            res += list(fmha_fwd_varlen(q, k, v, sq, sk, mask=m, return_lse=True))
        return tuple(res)


GROUP_ARGS = (*_packed(0, 10, 12), _starts([4, 6]), _starts([5, 7]))
GROUP_DYN = {"q": [0], "k": [0], "v": [0], "sq": [0], "sk": [0]}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    return _module(Group(), GROUP_ARGS, GROUP_DYN, tmp_path_factory.mktemp("group"))


@pytest.mark.parametrize("lq,lk", [([5, 0, 40, 1, 17], [9, 3, 40, 30, 0]),  # empty, decode, no keys
                                   ([1] * 9, list(range(1, 130, 16))),       # decode batch
                                   ([300], [77])])                           # one long, Sq > Sk
def test_group_mode_every_mask(group, lq, lk):
    q, k, v = _packed(len(lq), sum(lq), sum(lk))
    sq, sk = _starts(lq), _starts(lk)
    res = group(q, k, v, sq, sk)
    for j, m in enumerate(MASKS):
        out, lse = varlen_ref(q, k, v, sq, sk, mask=m)
        assert_close(res[2 * j], out, torch.float32, what=f"{m} {lq} {lk}")
        assert_close(res[2 * j + 1], lse, torch.float32, kind="lse", what=f"{m} {lq} {lk}")


def test_group_mode_batch_invariant_and_repeatable(group):
    """Sequence 700 x 900 alone, then between 20 short ones and in a batch of 33: its out and LSE
    rows bitwise equal; a repeated call bitwise equal."""
    lone = _packed(5, 700, 900)
    q0, k0, v0 = lone
    alone = group(q0, k0, v0, _starts([700]), _starts([900]))
    for others in (20, 32):
        lq, lk = [64] * others, [80] * others
        fq, fk, fv = _packed(others, sum(lq), sum(lk))
        at = others // 2
        q = torch.cat([fq[:64 * at], q0, fq[64 * at:]])
        k = torch.cat([fk[:80 * at], k0, fk[80 * at:]])
        v = torch.cat([fv[:80 * at], v0, fv[80 * at:]])
        lq.insert(at, 700), lk.insert(at, 900)
        batched = group(q, k, v, _starts(lq), _starts(lk))
        for j in range(0, len(MASKS) * 2, 2):
            np.testing.assert_array_equal(batched[j][64 * at:64 * at + 700], alone[j])
            np.testing.assert_array_equal(batched[j + 1][:, 64 * at:64 * at + 700], alone[j + 1])
    again = group(q0, k0, v0, _starts([700]), _starts([900]))
    for a, b in zip(alone, again):
        np.testing.assert_array_equal(a, b)


class Padded(torch.nn.Module):
    def forward(self, q, k, v, sq, sk, lk, pq, pk):
        return fmha_fwd_varlen(q, k, v, sq, sk, seqlen_k=lk, seqstart_padded_q=pq, seqstart_padded_k=pk, mask="b",
                               return_lse=True)


def test_padded_starts_and_seqlen_k(tmp_path):
    """Sequences stored with gaps (offsets from the padded starts, lengths from the unpadded
    ones) and fewer keys used than stored: rows no sequence owns are 0."""
    lq, lk, gq, gk, used = [3, 0, 20, 1], [10, 4, 30, 50], [2, 1, 0, 5], [0, 3, 7, 1], [10, 0, 25, 17]
    sq, sk, pq, pk = _starts(lq), _starts(lk), _starts(lq, gq), _starts(lk, gk)
    lkt = torch.tensor(used, dtype=torch.int32)
    q, k, v = _packed(9, int(pq[-1]), int(pk[-1]))
    args = (q, k, v, sq, sk, lkt, pq, pk)
    dyn = {"q": [0], "k": [0], "v": [0], "sq": [0], "sk": [0], "lk": [0], "pq": [0], "pk": [0]}
    out, lse = _module(Padded(), args, dyn, tmp_path)(*args)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, seqlen_k=lkt, seqstart_padded_q=pq, seqstart_padded_k=pk,
                                  mask="b")
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32, kind="lse")


class Paged(torch.nn.Module):
    def forward(self, q, kc, vc, sq, lk, bt):
        a = fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=lk, block_table=bt, mask="b", return_lse=True)
        b = fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=lk, block_table=bt, mask="t:5,3")
        return (*a, b)


def _table(seed, lens, page, n_pages):
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(n_pages))
    bt = np.full((len(lens), max(-(-n // page) for n in lens) + 1), -1, np.int32)
    for b, n in enumerate(lens):
        for i in range(-(-n // page)):
            bt[b, i] = free.pop()
    return torch.from_numpy(bt)


def _gathered(cache, bt, lens, page):
    """The used keys of each sequence, packed in order (the reference's input)."""
    rows = [cache[int(bt[b, j // page]), j % page] for b, n in enumerate(lens) for j in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros((0,) + cache.shape[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_cache(tmp_path, dtype):
    """A paged cache read through the block table (pages in random order): decode, prefill,
    an empty sequence and one without keys, against the reference over the gathered keys."""
    page, n_pages = 16, 40
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(n_pages, page, HK, D, generator=g).to(dtype), torch.randn(n_pages, page, HK, DV,
                                                                                    generator=g).to(dtype)
    lq, lk = [1, 30, 0, 7, 2], [40, 130, 5, 0, 17]
    bt = _table(1, lk, page, n_pages)
    sq, lkt = _starts(lq), torch.tensor(lk, dtype=torch.int32)
    q = torch.randn(sum(lq), HQ, D, generator=g).to(dtype)
    args = (q, kc, vc, sq, lkt, bt)
    run = _module(Paged(), args, {"q": [0], "kc": [0], "vc": [0], "sq": [0], "lk": [0], "bt": [0, 1]}, tmp_path)
    out, lse, out_t = run(*args)
    k, v, sk = _gathered(kc, bt, lk, page), _gathered(vc, bt, lk, page), _starts(lk)
    for res, m in ((out, "b"), (out_t, "t:5,3")):
        ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask=m)
        assert_close(res, ref_out, dtype, what=m)
    assert_close(lse, varlen_ref(q, k, v, sq, sk, mask="b")[1], dtype, kind="lse")


class BadPaged(torch.nn.Module):
    def forward(self, q, kc, vc, sq, sk, bt):
        return fmha_fwd_varlen(q, kc, vc, sq, sk, block_table=bt)


def test_refusals_before_iree_compile():
    """A paged call with seqstart_k and no seqlen_k, and q of the wrong rank: ValueErrors naming
    the argument at export."""
    q, kc, vc = torch.zeros(5, HQ, D), torch.zeros(4, 16, HK, D), torch.zeros(4, 16, HK, D)
    sq, bt = _starts([5]), torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        export_model(BadPaged(), (q, kc, vc, sq, sq, bt), target="host")
    with pytest.raises(ValueError, match=r"q \[Tq, Hq, Dq\]"):
        export_model(Group(), (q[None], *GROUP_ARGS[1:]), target="host")


class Variants(torch.nn.Module):
    """The soft-cap (a constant of the merged kernel) and sinks (a parameter of the model, applied
    by torch ops in its graph) at a batch-mode and a group-mode call site."""

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.tensor([1.5, -0.5, 3.0, 0.0]), requires_grad=False)

    def forward(self, q, k, v, sq, sk, qb, kb, vb):
        from fmha_iree.integrations.torch_ops import attention

        g = fmha_fwd_varlen(q, k, v, sq, sk, mask="b", return_lse=True, softcap=3.0, sinks=self.sinks)
        b = attention(qb, kb, vb, mask="t", layout="bshd", return_lse=True, softcap=3.0, sinks=self.sinks)
        return (*g, *b)


def test_softcap_and_sinks_inside_a_model(tmp_path):
    from reference import attention_ref

    qb, kb, vb = (x[None] for x in _packed(1, 12, 12))
    args = (*_packed(0, 10, 12), _starts([4, 6]), _starts([5, 7]), qb, kb, vb)
    dyn = {**GROUP_DYN, "qb": [1], "kb": [1], "vb": [1]}
    run = _module(Variants(), args, dyn, tmp_path)
    sinks = Variants().sinks.detach()
    lq, lk = [5, 0, 3, 9], [9, 4, 0, 30]
    q, k, v = (3 * x for x in _packed(3, sum(lq), sum(lk)))
    qb, kb, vb = (3 * x[None] for x in _packed(4, 20, 33))
    qb, kb, vb = qb[:, :20], kb[:, :33], vb[:, :33]
    sq, sk = _starts(lq), _starts(lk)
    out, lse, bo, bl = run(q, k, v, sq, sk, qb, kb, vb)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", softcap=3.0, sinks=sinks)
    assert_close(out, ref_out, torch.float32, what="group")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="group")
    ref_out, ref_lse = attention_ref(qb, kb, vb, mask="t", layout="bshd", softcap=3.0, sinks=sinks)
    assert_close(bo, ref_out, torch.float32, what="batch")
    assert_close(bl, ref_lse, torch.float32, kind="lse", what="batch")
