"""The CPU's ``rows`` entry point (short queries: decode, chunked prefill): any lengths and CK
mask in one call, routed by ``dispatch.rows_fit``; checked against the float64 reference, and the
tile plan it replaces checked on the same short cases.

Kernel keys: MAIN and f32-mqa4-bhsd (shared with test_layouts_gqa.py).
"""

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree import dispatch
from common import MAIN, check_fwd, len_id
from reference import make_qkv, seed_of

MQA4 = dict(Hq=4, Hk=1, Dq=64, Dv=64, dtype=torch.float32)


def cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def test_route_takes_rows_for_short_queries_only():
    q, k, v = make_qkv(1, B=2, Hq=4, Hk=1, Sq=32, Sk=500)
    r = fmha_iree.route(q, k, v, mask="b")
    assert (r.path, r.entry) == ("rows", "rows"), r
    assert "short queries" in r.reason
    q33 = make_qkv(1, B=2, Hq=4, Hk=1, Sq=33, Sk=500)[0]  # 4 * 33 rows per KV head: the plan
    assert fmha_iree.route(q33, k, v, mask="b").path == "plan"
    r = fmha_iree.route(q, k, v, mask="b", cu_seqlen_k=cu([500, 17]))
    assert (r.path, r.entry) == ("rows", "rows_kpad"), r


LENGTHS = [(1, 1), (1, 300), (5, 3), (17, 130), (64, 64), (128, 77), (3, 1000)]
MASKS = ["0", "t", "b", "t:3,0", "b:0,5", "b:-1,2", "xt:4", "xb:9"]


@pytest.mark.parametrize("path", ["rows", "plan"])
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[len_id(p) for p in LENGTHS])
@pytest.mark.parametrize("mask", MASKS)
def test_short_queries_every_mask(monkeypatch, path, sq, sk, mask):
    """Sq < Sk and Sq > Sk, tails of every size, rows that see no key (0 and lse -inf), through
    ``rows`` and through the tile plan (rows turned off)."""
    if path == "plan":
        monkeypatch.setattr(dispatch, "ROWS_MAX_ROWS", 0)
    q, k, v = make_qkv(seed_of("rows", sq, sk, mask), B=2, Hq=2, Sq=sq, Sk=sk, Dq=MAIN["Dq"], dtype=MAIN["dtype"])
    assert fmha_iree.route(q, k, v, mask=mask).path == path
    check_fwd(q, k, v, mask=mask, what=f"{path} {sq}x{sk} {mask}")


@pytest.mark.parametrize("mask", ["0", "b", "b:100,0", "t:0,0"])
def test_decode_against_8192_keys_mqa(mask):
    """Sq = 1 against 8192 keys, four query heads on one KV head, with LSE."""
    q, k, v = make_qkv(seed_of("decode", mask), B=3, Sq=1, Sk=8192, **MQA4)
    assert fmha_iree.route(q, k, v, mask=mask).path == "rows"
    check_fwd(q, k, v, mask=mask, what=f"decode {mask}")


@pytest.mark.parametrize("mask", ["0", "b", "t:2,1"])
def test_cu_seqlen_padding_takes_rows_and_never_reads_padding(mask):
    """Each batch's own lengths (the mask aligned to them); NaN in every padded row and key."""
    q, k, v = make_qkv(seed_of("rows-pad", mask), B=3, Sq=9, Sk=200, **MQA4)
    lq, lk = [9, 1, 4], [200, 3, 77]
    for x, lens in ((q, lq), (k, lk), (v, lk)):
        for b, n in enumerate(lens):
            x[b, :, n:] = float("nan")
    kw = dict(cu_seqlen_q=cu(lq), cu_seqlen_k=cu(lk))
    assert fmha_iree.route(q, k, v, mask=mask, **kw).entry == "rows_kpad"
    out, _ = check_fwd(q, k, v, mask=mask, what=f"padding {mask}", **kw)
    assert not torch.isnan(out).any()


def test_device_tensors_replay_rows():
    """DeviceTensors: the first call routes and prepares, repeats replay the same entry point."""
    q, k, v = make_qkv(seed_of("rows-dev"), B=2, Sq=1, Sk=333, **MQA4)
    qd, kd, vd = (fmha_iree.to_device(x) for x in (q, k, v))
    want = check_fwd(q, k, v, mask="b")
    for _ in range(3):
        out, lse = fmha_iree.fmha_fwd(qd, kd, vd, mask="b", return_lse=True)
        assert torch.equal(out.to_torch(), want[0]) and torch.equal(lse.to_torch(), want[1])
