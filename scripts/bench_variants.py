"""What the score variants cost on a GPU: the plain kernel, the soft-cap (a module compiled with
``--softcap``) and sinks (``sinks=``, applied to the results) at issue 58's two rows, with
FlexAttention (the same ``score_mod``) and SDPA measured in the same run; and sink tokens
(``b:1024,0,4``) against the same window without them.

Modules (sm_80, f16, d128, bshd), compiled beforehand with ``fmha-iree compile`` into ``--modules``:
``plain_g1.vmfb`` / ``cap_g1.vmfb`` (``--heads 16:16``, ``--softcap 50`` for the cap) for prefill
B4 H16 S4096 causal, ``plain_g4.vmfb`` / ``cap_g4.vmfb`` (``--heads 32:8``) for decode B16 Sk8192.

    python scripts/bench_variants.py --modules DIR [--reps 20] [--out DIR]
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_time, torch_device_time, write_rows  # noqa: E402

CAP = 50.0
WINDOW = "b:1024,0"  # a sliding window (Mistral's 4096 at a quarter of the prefill row's length)
ROWS = {"prefill": dict(B=4, Hq=16, Hk=16, Sq=4096, Sk=4096, mask="b", g="g1"),
        "decode": dict(B=16, Hq=32, Hk=8, Sq=1, Sk=8192, mask="0", g="g4")}


def _flex(q, k, v, causal: bool, softcap: bool):
    """FlexAttention (compiled) on bhsd tensors with a causal BlockMask and the soft-cap as its
    score_mod."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def cap(score, b, h, i, j):
        return CAP * torch.tanh(score / CAP)

    block = None
    if causal:
        block = create_block_mask(lambda b, h, i, j: j <= i, None, None, q.shape[2], k.shape[2], device=q.device)
    fn = torch.compile(flex_attention)
    return lambda: fn(q, k, v, score_mod=cap if softcap else None, block_mask=block, enable_gqa=True)


def _reference(q, k, v, causal: bool, softcap: bool, sinks, window: int = -1, sink_tokens: int = 0):
    """float32 attention of [B, S, H, D] tensors with the soft-cap, sinks and sink tokens as the
    issue states them (one KV head at a time, so the score matrix stays [B, G, Sq, Sk]); ``window``
    keys to the left of the bottom-right diagonal (-1: all)."""
    import torch

    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    out = torch.empty(B, Sq, Hq, v.shape[-1], device=q.device)
    for h in range(Hk):
        qh = q[:, :, h * G:(h + 1) * G].float().permute(0, 2, 1, 3)  # [B, G, Sq, D]
        s = qh @ k[:, :, h].float().transpose(1, 2)[:, None] / D ** 0.5
        if softcap:
            s = CAP * torch.tanh(s / CAP)
        if causal:
            i = torch.arange(Sq, device=q.device)[:, None] + Sk - Sq
            j = torch.arange(Sk, device=q.device)[None, :]
            seen = (j <= i) & ((j >= i - window) | (j < sink_tokens) if window >= 0 else True)
            s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sk = sinks[h * G:(h + 1) * G].float()[None, :, None, None].expand(B, G, Sq, 1)
            p = torch.softmax(torch.cat([s, sk], -1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        out[:, :, h * G:(h + 1) * G] = (p @ v[:, :, h].float()[:, None]).permute(0, 2, 1, 3)
        del s, p
    return out


def run_row(name: str, mods: dict, reps: int) -> list[dict]:
    import torch

    import fmha_iree

    r = ROWS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(r["B"], r["Sq"], r["Hq"], 128, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(r["B"], r["Sk"], r["Hk"], 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    sinks = torch.randn(r["Hq"], device="cuda", generator=g)
    plain = fmha_iree.load(mods[f"plain_{r['g']}"], device="cuda://0")
    capped = fmha_iree.load(mods[f"cap_{r['g']}"], device="cuda://0")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    causal = r["mask"] == "b"
    qd, kd, vd = (fmha_iree.to_device(x.cpu().numpy(), "cuda://0") for x in (q, k, v))
    calls = {  # torch tensors in and out (what a torch caller sees), then DeviceTensors (the kernels)
        "fmha_plain": lambda: plain(q, k, v, mask=r["mask"]),
        "fmha_softcap": lambda: capped(q, k, v, mask=r["mask"]),
        "fmha_sinks": lambda: plain(q, k, v, mask=r["mask"], sinks=sinks),
        "flex_plain": _flex(qt, kt, vt, causal, False),
        "flex_softcap": _flex(qt, kt, vt, causal, True),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                         enable_gqa=True),
    }
    calls.update({"fmha_window": lambda: plain(q, k, v, mask=WINDOW),  # the baseline of the sink tokens' row
                  "fmha_window_sink4": lambda: plain(q, k, v, mask=WINDOW + ",4")})
    device_calls = {"fmha_plain_dev": lambda: plain(qd, kd, vd, mask=r["mask"]),
                    "fmha_softcap_dev": lambda: capped(qd, kd, vd, mask=r["mask"])}
    win = int(WINDOW.split(":")[1].split(",")[0])
    refs = {"fmha_plain": (causal, False, None), "fmha_softcap": (causal, True, None), "fmha_sinks": (causal, False, sinks),
            "fmha_window": (True, False, None, win), "fmha_window_sink4": (True, False, None, win, 4)}
    times, errs = {}, {}
    for key, fn in [*calls.items(), *device_calls.items()]:
        try:
            times[key] = (device_time(fn, reps) if key.endswith("_dev") else torch_device_time(fn, reps))
            if key in refs:
                out = fn()
                errs[key] = float((out.float() - _reference(q, k, v, *refs[key])).abs().max())
        except Exception as e:  # noqa: BLE001 (a peer that does not take the shape: reported, not fatal)
            print(f"{name} {key}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            times[key] = None
    flops = 4 * r["B"] * r["Hq"] * r["Sq"] * r["Sk"] * 128 / (2 if causal else 1)
    rows = []
    for key, t in times.items():
        base = times["fmha_plain_dev" if key.endswith("_dev") else "fmha_plain"]
        row = dict(row=name, call=key, ms=None if t is None else t * 1e3,
                   tflops=None if t is None else flops / t / 1e12,
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
    args = ap.parse_args()
    mods = {p.stem: p for p in Path(args.modules).glob("*.vmfb")}
    rows = []
    for name in ROWS:
        rows += run_row(name, mods, args.reps)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
