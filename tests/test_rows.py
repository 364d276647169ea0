"""The CPU's ``rows`` entry point (short queries: decode, chunked prefill): any lengths and CK
mask in one call, routed by ``paths.rows`` (``policy.ROWS_MAX_ROWS``); checked against the float64 reference, and the
tile plan it replaces checked on the same short cases.

Kernel keys: MAIN and f32-mqa4-bhsd (shared with test_layouts_gqa.py).
"""

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.paths import cpu_short
from common import MAIN, check_fwd, cu, hide_entries, len_id, set_policy, spy_calls
from reference import make_qkv, seed_of

MQA4 = dict(Hq=4, Hk=1, Dq=64, Dv=64, dtype=torch.float32)


def test_route_takes_rows_for_short_queries_only():
    q, k, v = make_qkv(1, B=2, Hq=4, Hk=1, Sq=32, Sk=500)
    r = fmha_iree.route(q, k, v, mask="b")
    assert (r.path, r.entry) == ("rows", "rows"), r
    assert "short queries" in r.reason
    q33 = make_qkv(1, B=2, Hq=4, Hk=1, Sq=33, Sk=500)[0]  # 4 * 33 rows per KV head: units
    assert fmha_iree.route(q33, k, v, mask="b").path == "units"
    r = fmha_iree.route(q, k, v, mask="b", cu_seqlen_k=cu([500, 17]))
    assert (r.path, r.entry) == ("rows", "rows_kpad"), r


def test_route_explains_the_paths_refused_before():
    """``str(route)`` names the mode, the path and its entry, why it takes the call, and every path
    tried before it with its reasons: a CPU module's short batch call goes to ``rows`` past
    ``compiled_in`` (no compiled-in entries without --seqlens), ``dense`` and ``cpu_group``."""
    q, k, v = make_qkv(1, B=2, Hq=4, Hk=1, Sq=32, Sk=500)
    r = fmha_iree.route(q, k, v, mask="b")
    assert (r.mode, r.path) == ("batch", "rows") and r.reason == r.why
    rejected = dict(r.rejected)
    assert list(rejected) == ["compiled_in", "dense", "cpu_group"], r.rejected
    assert any("no compiled-in" in why for why in rejected["compiled_in"]), rejected
    assert all(reasons for reasons in rejected.values()), rejected
    text = str(r)
    lines = text.splitlines()
    assert lines[0].startswith("batch mode: rows (rows): ") and r.why in lines[0], text
    assert lines[1].startswith("  not compiled_in: ") and "no compiled-in" in lines[1], text
    for name, reasons in r.rejected:
        assert f"  not {name}: " + "; ".join(reasons) in lines, text


LENGTHS = [(1, 1), (1, 300), (5, 3), (17, 130), (64, 64), (128, 77), (3, 1000)]
MASKS = ["0", "t", "b", "t:3,0", "b:0,5", "b:-1,2", "xt:4", "xb:9"]


@pytest.mark.parametrize("path", ["rows", "units", "plan"])
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[len_id(p) for p in LENGTHS])
@pytest.mark.parametrize("mask", MASKS)
def test_short_queries_every_mask(monkeypatch, path, sq, sk, mask):
    """Sq < Sk and Sq > Sk, tails of every size, rows that see no key (0 and lse -inf), through
    ``rows``, through ``units`` (rows turned off) and through the tile plan (a module without
    ``units``, as CPU modules built before 2026-12-04); group mode turned off (``test_waves_cpu``)."""
    set_policy(monkeypatch, BATCH_WAVE_MIN_ROWS=1 << 30)
    if path != "rows":
        set_policy(monkeypatch, ROWS_MAX_ROWS=0)
    if path == "plan":
        hide_entries(monkeypatch, "units", "waves_varlen")
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


# Group mode: sequences of short queries go to ``rows`` in padded groups, the others to the plan.
GROUP_LQ = [1, 0, 5, 200, 3, 1, 64, 1]
GROUP_LK = [300, 7, 5, 250, 0, 1, 64, 4000]


@pytest.mark.parametrize("path", ["rows", "plan"])
@pytest.mark.parametrize("mask", ["0", "b", "t", "b:3,0", "xb:4"])
def test_group_mode_short_sequences(monkeypatch, path, mask):
    """Short and long sequences, zero-length q or k, seqlen_k, padded starts, GQA, LSE: each
    sequence against its own keys under its own mask, with ``rows`` (group mode's ``rows_packed``)
    on and off (``path`` "plan": the short sequences then take the other calls)."""
    from reference import varlen_ref

    if path == "plan":
        set_policy(monkeypatch, ROWS_MAX_ROWS=0, PACKED_MAX_QUERIES=0, PACKED_MAX_QUERIES_MHA=0)
    calls = spy_calls(monkeypatch)
    sq = np.concatenate([[0], np.cumsum(GROUP_LQ)]).astype(np.int32)
    sk = np.concatenate([[0], np.cumsum(GROUP_LK)]).astype(np.int32)
    used = np.array([max(n - 3, 0) if i % 3 == 0 else n for i, n in enumerate(GROUP_LK)], np.int32)
    gap = np.arange(len(GROUP_LQ) + 1, dtype=np.int32) * 2  # two unused rows before each sequence
    q, k, v = make_qkv(seed_of("group-rows", mask), B=1, Hq=2, Hk=1, Sq=int(sq[-1] + gap[-1]),
                       Sk=int(sk[-1] + gap[-1]), layout="bshd")
    q, k, v = q[0], k[0], v[0]
    for x, starts in ((q, sq), (k, sk), (v, sk)):  # the gap before the second sequence: never read
        x[starts[1] + gap[0]: starts[1] + gap[1]] = float("nan")
    kw = dict(seqlen_k=used, seqstart_padded_q=sq + gap, seqstart_padded_k=sk + gap, mask=mask)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, return_lse=True, **kw)
    assert ("rows_packed" in [fn for fn, _, _ in calls]) == (path == "rows"), [fn for fn, _, _ in calls]
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, **kw)
    from reference import assert_close

    assert_close(out, ref_out, torch.float32, kind="out", what=f"{path} {mask}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"{path} {mask}")


def test_group_mode_short_sequences_in_key_buckets(monkeypatch):
    """Decode sequences of spread key counts go to ``rows`` in several groups of similar keys
    (``GROUP_KEYS`` made small so that a small problem splits): every sequence in exactly one
    group, none grown past ``PAD_LIMIT`` once it held ``GROUP_KEYS`` keys, and each
    sequence against its own keys (float64 reference), LSE too."""
    from reference import assert_close, varlen_ref

    set_policy(monkeypatch, GROUP_KEYS=40)
    lk = np.array([3, 200, 17, 64, 1, 130, 90, 9, 33, 250, 41, 5], np.int64)
    lq = np.array([1, 1, 2, 1, 1, 3, 1, 1, 2, 1, 1, 1], np.int64)
    p = type("P", (), {"hq": 4, "hk": 1})()
    groups = cpu_short.short_sequences(p, lq, lk)
    assert len(groups) > 2 and sorted(np.concatenate(groups).tolist()) == list(range(len(lk)))
    for grp in groups:  # a group grows past the bound only while it holds fewer than GROUP_KEYS
        keys = np.sort(lk[grp])
        assert keys[:-1].sum() < 40 or len(keys) * keys[-1] <= cpu_short.PAD_LIMIT * keys.sum(), keys
    sq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    sk = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = make_qkv(seed_of("group-buckets"), B=1, Hq=4, Hk=1, Sq=int(sq[-1]), Sk=int(sk[-1]), layout="bshd")
    q, k, v = q[0], k[0], v[0]
    for mask in ("b", "t:2,1"):
        out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, mask=mask, return_lse=True)
        ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask=mask)
        assert_close(out, ref_out, torch.float32, kind="out", what=f"buckets {mask}")
        assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"buckets {mask}")


@pytest.mark.parametrize("hq,hk,qlen,packed", [(4, 1, 16, True), (4, 1, 17, False), (2, 2, 8, True), (2, 2, 9, False)])
def test_group_mode_short_queries_choose_packed_by_group(monkeypatch, hq, hk, qlen, packed):
    """Sequences of up to 16 query rows take ``rows_packed`` with GQA (up to 64 rows per KV head),
    up to 8 without (``paths.cpu_short.packed_fits``), ``waves_varlen`` above; each sequence by its
    own query rows (the 3- and 1-row sequences beside longer ones still take ``rows_packed``);
    either way each sequence against its own keys (float64 reference)."""
    from reference import assert_close, varlen_ref

    calls = spy_calls(monkeypatch)
    lq, lk = [qlen, 3, qlen, 1], [40, 300, qlen, 77]
    sq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    sk = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = make_qkv(seed_of("packed-by-group", hq, qlen), B=1, Hq=hq, Hk=hk, Sq=int(sq[-1]), Sk=int(sk[-1]),
                       layout="bshd")
    q, k, v = q[0], k[0], v[0]
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, mask="b", return_lse=True)
    seen = [fn for fn, _, _ in calls]
    assert ("waves_varlen" in seen) != packed, seen
    # the query rows of the sequences rows_packed took (its descriptor's qlen column)
    in_packed = sorted(int(n) for fn, args, _ in calls if fn == "rows_packed" for n in args[4].array[:, 1])
    assert in_packed == sorted([qlen, 3, qlen, 1] if packed else [3, 1]), (seen, in_packed)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b")
    assert_close(out, ref_out, torch.float32, kind="out", what=f"G={hq // hk} qlen {qlen}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"G={hq // hk} qlen {qlen}")
