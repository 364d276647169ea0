"""What ALiBi costs on a GPU: an ALiBi module (``fmha-iree compile --alibi``: ``fwd_tiles`` with
the slopes as an argument) against the plain module on the same problem, with FlexAttention (an
ALiBi ``score_mod``, a causal BlockMask) and SDPA (no ALiBi) measured in the same run, at issue
58's prefill row (B4 H16 S4096 causal) and an MHA decode row (B16 H32 Sk8192: ALiBi models are
MHA), plus a paged decode (pages of 64 rows in shuffled order). Errors against a float32
reference of the issue's formula.

Modules (sm_80, f16, d128, bshd), compiled beforehand into ``--modules``: ``plain_p`` /
``alibi_p`` (``--heads 16:16``), ``plain_d`` / ``alibi_d`` (``--heads 32:32``); where ``bias_p`` /
``bias_d`` (``--bias``) are there too, the same ALiBi as an elementwise bias tensor ``[1, H, Sq,
Sk]`` (f16) on them, and FlexAttention with a ``score_mod`` reading that tensor.

    python scripts/bench_alibi.py --modules DIR [--reps 20] [--out DIR]
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import torch_device_time, write_rows  # noqa: E402

ROWS = {"prefill": dict(B=4, H=16, Sq=4096, Sk=4096, mask="b", mods=("plain_p", "alibi_p"), bias="bias_p"),
        "decode": dict(B=16, H=32, Sq=1, Sk=8192, mask="b", mods=("plain_d", "alibi_d"), bias="bias_d")}
PAGE = 64


def slopes(h: int):
    """BLOOM's slopes for ``h`` heads (a power of two): ``2 ** (-8 (i + 1) / h)``."""
    import torch

    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32, device="cuda")


def _flex(q, k, v, sl):
    """FlexAttention (compiled) on bhsd tensors: causal BlockMask (bottom-right), ALiBi score_mod."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    off = k.shape[2] - q.shape[2]

    def alibi(score, b, h, i, j):
        return score - sl[h] * (i + off - j).abs()

    block = create_block_mask(lambda b, h, i, j: j <= i + off, None, None, q.shape[2], k.shape[2], device=q.device)
    fn = torch.compile(flex_attention)
    return lambda: fn(q, k, v, score_mod=alibi, block_mask=block)


def _bias_tensor(sq: int, sk: int, sl):
    """The ALiBi bias as an elementwise bias ``[1, H, Sq, Sk]`` f16 (bottom-right frame)."""
    import torch

    i = torch.arange(sq, device="cuda")[:, None] + sk - sq
    j = torch.arange(sk, device="cuda")[None, :]
    return (-sl[:, None, None] * (i - j).abs()[None]).to(torch.float16)[None]


def _flex_bias(q, k, v, bias):
    """FlexAttention (compiled) on bhsd tensors: causal BlockMask (bottom-right), a score_mod reading ``bias``."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    off = k.shape[2] - q.shape[2]

    def add(score, b, h, i, j):
        return score + bias[0, h, i, j]

    block = create_block_mask(lambda b, h, i, j: j <= i + off, None, None, q.shape[2], k.shape[2], device=q.device)
    fn = torch.compile(flex_attention)
    return lambda: fn(q, k, v, score_mod=add, block_mask=block)


def _reference(q, k, v, sl):
    """float32 causal (bottom-right) attention of [B, S, H, D] tensors with ALiBi, head by head."""
    import torch

    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    i = torch.arange(Sq, device=q.device)[:, None] + Sk - Sq
    j = torch.arange(Sk, device=q.device)[None, :]
    out = torch.empty(B, Sq, H, v.shape[-1], device=q.device)
    for h in range(H):
        s = q[:, :, h].float() @ k[:, :, h].float().transpose(1, 2) / D ** 0.5 - sl[h] * (i - j).abs()
        p = torch.softmax(s.masked_fill(j > i, float("-inf")), -1)
        out[:, :, h] = p @ v[:, :, h].float()
        del s, p
    return out


def _paged(k, v):
    """K / V as a cache of shuffled pages: (k_cache, v_cache, block_table, seqlen_k)."""
    import torch

    B, Sk, H, D = k.shape
    n = Sk // PAGE
    perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(0)).cuda()
    kc, vc = torch.empty(B * n, PAGE, H, D, device="cuda", dtype=k.dtype), torch.empty_like(k).view(B * n, PAGE, H, D)
    kc[perm], vc[perm] = k.reshape(B * n, PAGE, H, D), v.reshape(B * n, PAGE, H, D)
    table = perm.view(B, n).to(torch.int32).cpu().numpy()
    return kc, vc, table, [Sk] * B


def _profile(name: str, calls: dict):
    """Each call's CUDA kernels (torch.profiler sees IREE's launches too): name and GPU time per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for key, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"-- {name} {key}: kernels (us per call)")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            print(f"   {ev.device_time_total / 5:9.1f}  {ev.key[:100]}")


def run_row(name: str, mods: dict, reps: int, profile: bool = False) -> list[dict]:
    import numpy as np
    import torch

    import fmha_iree

    r = ROWS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(r["B"], r["Sq"], r["H"], 128, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(r["B"], r["Sk"], r["H"], 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    sl = slopes(r["H"])
    sl_host = sl.cpu().numpy()  # a model's constant: host slopes are uploaded once (a CUDA tensor would sync per call)
    plain, alibi = (fmha_iree.load(mods[m], device="cuda://0") for m in r["mods"])
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    calls = {"fmha_plain": lambda: plain(q, k, v, mask=r["mask"]),
             "fmha_alibi": lambda: alibi(q, k, v, mask=r["mask"], alibi_slopes=sl_host),
             "flex_alibi": _flex(qt, kt, vt, sl),
             "sdpa_plain": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=r["Sq"] > 1)}
    if r["bias"] in mods:
        bias_mod = fmha_iree.load(mods[r["bias"]], device="cuda://0")
        bt = _bias_tensor(r["Sq"], r["Sk"], sl)
        calls["fmha_bias"] = lambda: bias_mod(q, k, v, mask=r["mask"], bias=bt)
        calls["flex_bias"] = _flex_bias(qt, kt, vt, bt)
    if name == "decode":
        kc, vc, table, lens = _paged(k, v)
        sq = np.arange(r["B"] + 1, dtype=np.int32)
        qv = q.reshape(r["B"], r["H"], 128)
        calls["fmha_plain_paged"] = lambda: plain.varlen(qv, kc, vc, sq, None, seqlen_k=lens, block_table=table,
                                                         mask="b")
        calls["fmha_alibi_paged"] = lambda: alibi.varlen(qv, kc, vc, sq, None, seqlen_k=lens, block_table=table,
                                                         mask="b", alibi_slopes=sl_host)
        if r["bias"] in mods:
            calls["fmha_bias_paged"] = lambda: bias_mod.varlen(qv, kc, vc, sq, None, seqlen_k=lens, block_table=table,
                                                               mask="b", bias=bt)
    if profile:
        _profile(name, {key: calls[key] for key in calls if key.startswith("fmha_")})
    ref = _reference(q, k, v, sl)
    times, errs = {}, {}
    for key, fn in calls.items():
        try:
            times[key] = torch_device_time(fn, reps)
            if "alibi" in key or "bias" in key:
                out = fn()
                out = out.transpose(1, 2) if key.startswith("flex") else out.reshape(ref.shape)
                errs[key] = float((out.float() - ref).abs().max())
        except Exception as e:  # noqa: BLE001 (a peer that does not take the shape: reported, not fatal)
            print(f"{name} {key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            times[key] = None
    rows = []
    for key, t in times.items():
        base = times["fmha_plain_paged" if key.endswith("_paged") else "fmha_plain"]
        row = dict(row=name, call=key, ms=None if t is None else t * 1e3,
                   vs_fmha_plain=None if t is None or not base else t / base, max_abs_err=errs.get(key))
        print(f"{name:8} {key:17} {row['ms'] if t else math.nan:9.4f} ms  x{row['vs_fmha_plain'] or math.nan:.3f}"
              f"  err {errs.get(key, math.nan):.2e}", flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="also print each fmha call's CUDA kernels")
    args = ap.parse_args()
    mods = {p.stem: p for p in Path(args.modules).glob("*.vmfb")}
    rows = []
    for name in ROWS:
        rows += run_row(name, mods, args.reps, args.profile)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
