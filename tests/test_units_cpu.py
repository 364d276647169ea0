"""The CPU's ``units`` entry point (``mlir_templates.unit_loop``: any batch-mode problem in one call,
the tile plan's units looped inside the module), checked against the float64 reference.

Covered: tails that are no multiple of the unit (1..127 rows / keys past a unit), Sq < Sk and
Sq > Sk under every mask kind, rows that see no key (out 0, lse -inf), several row tiles and key
chunks (units of 256 x 512), GQA / MQA, both layouts, f32 / f16 / bf16, LSE; and the route: short
queries keep ``rows``, cu_seqlen padding the plan.
"""

import pytest
import torch

import fmha_iree
from common import MAIN, check_fwd, cu, len_id, set_policy
from reference import make_qkv, seed_of


def test_route_takes_units_past_short_queries():
    """units past rows' short queries and group mode's middling lengths (``paths.cpu_group``);
    cu_seqlen padding in bhsd: group mode up to ``WAVE_MAX_ROWS`` rows, else the plan."""
    q, k, v = make_qkv(1, B=2, Hq=2, Hk=1, Sq=300, Sk=1100)
    r = fmha_iree.route(q, k, v, mask="b")
    assert (r.path, r.entry) == ("units", "units"), r
    assert "one call" in r.reason
    assert fmha_iree.route(q[:, :, :32], k, v, mask="b").path == "rows"
    assert fmha_iree.route(q[:, :, :, :], k[:, :, :1000], v[:, :, :1000], mask="b").path == "cpu_group"
    assert fmha_iree.route(q, k, v, mask="b", cu_seqlen_k=cu([1000, 17])).path == "cpu_group"
    q6 = make_qkv(2, B=2, Hq=2, Hk=1, Sq=600, Sk=1100)[0]
    assert fmha_iree.route(q6, k, v, mask="b", cu_seqlen_k=cu([1000, 17])).path == "plan"


LENGTHS = [(1, 129), (127, 1), (77, 130), (130, 77), (300, 1100), (600, 513), (513, 600)]
MASKS = ["0", "b", "t", "b:20,0", "t:3,40", "b:0,0", "xb:9", "t:-1,5", "b:-1,2"]


@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[len_id(p) for p in LENGTHS])
@pytest.mark.parametrize("mask", MASKS)
def test_units_every_mask_and_tail(monkeypatch, sq, sk, mask):
    """Every mask over tails, Sq < Sk and Sq > Sk (short queries too: ``rows`` and group mode
    turned off)."""
    set_policy(monkeypatch, ROWS_MAX_ROWS=0, BATCH_WAVE_MIN_ROWS=1 << 30)
    q, k, v = make_qkv(seed_of("units", sq, sk, mask), B=2, Hq=2, Sq=sq, Sk=sk, Dq=MAIN["Dq"], dtype=MAIN["dtype"])
    assert fmha_iree.route(q, k, v, mask=mask).path == "units"
    check_fwd(q, k, v, mask=mask, what=f"units {sq}x{sk} {mask}")


@pytest.mark.parametrize("dtype,layout,hq,hk", [(torch.float16, "bhsd", 4, 1), (torch.bfloat16, "bshd", 4, 2),
                                                (torch.float32, "bshd", 2, 2)],
                         ids=["f16-mqa4-bhsd", "bf16-gqa2-bshd", "f32-bshd"])
@pytest.mark.parametrize("mask", ["b", "t:100,0", "0"])
def test_units_gqa_layouts_dtypes(dtype, layout, hq, hk, mask):
    """The G query heads of a KV head as rows (g, s) of its units, in either layout and dtype
    (bshd: keys past ``policy.BATCH_WAVE_MAX_KEYS``, below which the batch runs as group mode)."""
    q, k, v = make_qkv(seed_of("units-gqa", str(dtype), layout, mask), B=2, Hq=hq, Hk=hk, Sq=333, Sk=1100, Dq=64,
                       dtype=dtype, layout=layout)
    assert fmha_iree.route(q, k, v, mask=mask, layout=layout).path == "units"
    check_fwd(q, k, v, mask=mask, layout=layout, what=f"units {dtype} {layout} {hq}/{hk} {mask}")


def test_units_head_dims_differ():
    """Dq != Dv."""
    q, k, v = make_qkv(seed_of("units-dv"), B=1, Hq=2, Hk=2, Sq=260, Sk=1100, Dq=64, Dv=32)
    assert fmha_iree.route(q, k, v, mask="b").path == "units"
    check_fwd(q, k, v, mask="b", what="units dq64 dv32")


def test_units_device_tensors_replayed():
    """DeviceTensors on the CPU device take ``units`` too, prepared once and replayed
    (``paths.prepare_batch``); results stay DeviceTensors."""
    from reference import assert_close, attention_ref

    q, k, v = make_qkv(seed_of("units-device"), B=2, Hq=4, Hk=2, Sq=300, Sk=700)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b")
    d = [fmha_iree.to_device(x) for x in (q, k, v)]
    assert fmha_iree.route(*d, mask="b").path == "units"
    for _ in range(3):  # the first call prepares, the others replay
        out, lse = fmha_iree.fmha_fwd(*d, mask="b", return_lse=True)
        assert_close(out.to_torch(), ref_out, torch.float32, what="units device out")
        assert_close(lse.to_torch(), ref_lse, torch.float32, kind="lse", what="units device lse")
