"""The CPU's ``units_varlen`` entry point (``mlir_templates.unit_varlen``: group mode's long
sequences in one call, a table of row tiles looped inside the module), checked against the
float64 group-mode reference.

Covered: many sequences of over ``policy.WAVE_MAX_ROWS`` rows (shorter ones take
``waves_varlen``) with tails of 1..127 rows past a 128-row tile and keys past a 128-key step,
Sq != Sk per sequence under every mask kind, zero-length q or k, short sequences packed between
long ones (a long one's last tile runs past its rows into theirs), padded starts
and ``seqlen_k`` (the results copied out row by row), GQA / MQA, f32 / f16 / bf16, Dq != Dv, LSE;
NaN in one sequence's keys reaching no other sequence; one call per problem; batch mode with
cu_seqlen padding in bshd (each batch entry a sequence); and modules built
before ``units_varlen`` (the tile plan).
"""

import numpy as np
import pytest
import torch

import fmha_iree
from common import check_fwd, cu, hide_entries, spy_calls
from reference import make_qkv, seed_of, varlen_ref
from test_varlen import check_varlen, packed, starts

# (id, query lengths, key lengths): tails past 256-row tiles and 128-key steps, Sq != Sk, short
# sequences (<= 128 rows: ``rows``) between long ones, zero-length q and k
SEQS = [
    ("tails", [513, 600, 767, 129, 639], [513, 700, 129, 1000, 641]),
    ("mixed", [1, 600, 20, 0, 140, 7, 260, 2], [5, 600, 333, 4, 0, 128, 900, 2]),
    ("last-without-keys", [600, 530], [590, 0]),
]
MASKS = ["0", "b", "t", "b:20,0", "t:3,40", "b:0,0", "xb:9", "t:-1,5"]


def spy_tables(monkeypatch, fn: str = "units_varlen") -> list:
    """The calls of the packed-sequence entry point ``fn`` (``FmhaModule.call`` of ``fn``)."""
    return spy_calls(monkeypatch, fn)


def _spy(monkeypatch):
    return spy_tables(monkeypatch)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name,lq,lk", SEQS, ids=[s[0] for s in SEQS])
def test_every_mask_one_call(monkeypatch, name, lq, lk, mask):
    calls = _spy(monkeypatch)
    q, k, v = packed(seed_of("units-varlen", name, mask), sum(lq), sum(lk))
    check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"units_varlen {name} {mask}")
    assert len(calls) == 1, f"{len(calls)} units_varlen calls"


# (dtype, Hq, Hk, Dv) of the GQA / dtype / head-dim checks, shared with test_waves_cpu
GQA_CASES = [(torch.float16, 4, 1, 64), (torch.bfloat16, 4, 2, 64), (torch.float32, 2, 2, 32)]
GQA_IDS = ["f16-mqa4", "bf16-gqa2", "f32-dv32"]


def check_gqa(what, lq, lk, dtype, hq, hk, dv, mask):
    """Group mode with G query heads per KV head, storage ``dtype`` and ``dv`` (float64 reference)."""
    q, k, v = packed(seed_of(what, str(dtype), hq, mask), sum(lq), sum(lk), Hq=hq, Hk=hk, Dv=dv, dtype=dtype)
    check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"{what} {dtype} {hq}/{hk} dv{dv} {mask}")


def check_padded(what, lq, lk, used, mask):
    """Gaps before sequences and keys past ``seqlen_k`` (``used``): the rows copied out one sequence
    at a time."""
    pq, pk = starts(lq, [2, 3, 0, 4]), starts(lk, [0, 5, 2, 6])
    q, k, v = packed(seed_of(what, mask), int(pq[-1]), int(pk[-1]))
    check_varlen(q, k, v, starts(lq), starts(lk), seqstart_padded_q=pq, seqstart_padded_k=pk,
                 seqlen_k=torch.tensor(used, dtype=torch.int32), mask=mask, what=f"{what} {mask}")


def check_nan_isolation(what, lens):
    """NaN in sequence 1's keys and values (causal, Sq == Sk): every other sequence stays finite
    and exact."""
    lq = lk = list(lens)
    q, k, v = packed(seed_of(what), sum(lq), sum(lk))
    ref_out, ref_lse = varlen_ref(q, k, v, starts(lq), starts(lk), mask="b")
    a1, b1 = lq[0], lq[0] + lq[1]
    k[a1:b1], v[a1:b1] = float("nan"), float("nan")
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, starts(lq), starts(lk), mask="b", return_lse=True)
    bounds = [int(x) for x in starts(lq)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if i == 1:
            continue
        assert torch.isfinite(out[a:b]).all(), f"NaN leaked into rows {a}:{b}"
        np.testing.assert_allclose(out[a:b].double().numpy(), ref_out[a:b], atol=2e-5)
        np.testing.assert_allclose(lse[:, a:b].double().numpy(), ref_lse[:, a:b], atol=2e-5)


@pytest.mark.parametrize("dtype,hq,hk,dv", GQA_CASES, ids=GQA_IDS)
@pytest.mark.parametrize("mask", ["b", "t:100,0"])
def test_gqa_dtypes_head_dims(dtype, hq, hk, dv, mask):
    check_gqa("units-varlen-gqa", [600, 5, 129], [590, 700, 260], dtype, hq, hk, dv, mask)


@pytest.mark.parametrize("mask", ["b", "0"])
def test_padded_starts_and_seqlen_k(mask):
    check_padded("units-varlen-padded", [560, 3, 400], [570, 9, 500], [500, 9, 499], mask)


def test_nan_keys_stay_in_their_sequence():
    """Sequences 0 and 2's last key steps run into sequence 1's and 3's keys."""
    check_nan_isolation("units-varlen-nan", [600, 200, 560, 150])


def test_modules_without_units_varlen(monkeypatch):
    """Modules built before ``units_varlen`` (and ``waves_varlen``): the tile plan."""
    hide_entries(monkeypatch, "units_varlen", "waves_varlen")
    calls = _spy(monkeypatch)
    lq, lk = [300, 7, 260], [300, 40, 700]
    q, k, v = packed(seed_of("units-varlen-old"), sum(lq), sum(lk))
    check_varlen(q, k, v, starts(lq), starts(lk), mask="b", what="the plan")
    assert not calls


@pytest.mark.parametrize("mask", ["b", "t:30,0", "0"])
def test_batch_cu_seqlen_bshd_short(monkeypatch, mask):
    """Batch mode with cu_seqlen padding whose entries are all short: one ``waves_varlen`` call."""
    calls = spy_tables(monkeypatch, "waves_varlen")
    lq, lk = [150, 0, 200, 37], [200, 9, 0, 130]
    q, k, v = make_qkv(seed_of("waves-batch", mask), B=4, Hq=4, Hk=2, Sq=200, Sk=200, layout="bshd")
    r = fmha_iree.route(q, k, v, mask=mask, layout="bshd", cu_seqlen_q=cu(lq), cu_seqlen_k=cu(lk))
    assert (r.path, r.entry) == ("cpu_group", "waves_varlen")
    check_fwd(q, k, v, mask=mask, layout="bshd", cu_seqlen_q=cu(lq), cu_seqlen_k=cu(lk), what=f"waves batch {mask}")
    assert len(calls) == 1


def test_batch_cu_seqlen_without_query_rows():
    """cu_seqlen_q all zero in a bshd batch: out 0, lse -inf, nothing called."""
    q, k, v = make_qkv(seed_of("units-varlen-batch-empty"), B=2, Hq=2, Hk=2, Sq=300, Sk=400, layout="bshd")
    check_fwd(q, k, v, mask="b", layout="bshd", cu_seqlen_q=cu([0, 0]), cu_seqlen_k=cu([400, 3]), what="no rows")


@pytest.mark.parametrize("mask", MASKS)
def test_batch_cu_seqlen_bshd(monkeypatch, mask):
    """Batch mode with cu_seqlen padding in bshd: each batch entry one sequence of units_varlen
    (rows past its length 0, lse -inf; an entry without keys too), rows too many for ``rows``."""
    calls = _spy(monkeypatch)
    lq, lk = [600, 0, 140, 530], [580, 9, 0, 640]
    q, k, v = make_qkv(seed_of("units-varlen-batch", mask), B=4, Hq=4, Hk=2, Sq=640, Sk=640, layout="bshd")
    cq, ck = cu(lq), cu(lk)
    assert fmha_iree.route(q, k, v, mask=mask, layout="bshd", cu_seqlen_q=cq, cu_seqlen_k=ck).path == "cpu_group"
    check_fwd(q, k, v, mask=mask, layout="bshd", cu_seqlen_q=cq, cu_seqlen_k=ck, what=f"units_varlen batch {mask}")
    assert len(calls) == 1
