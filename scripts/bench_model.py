#!/usr/bin/env python3
"""A model with fmha_iree inside, on a GPU: one prefill step and one decode step of the example
decoder (``examples/llama_export.py``, f16, 4 layers, 16:4 heads of 128, a paged cache) exported
as one module with fmha_iree's kernel inside, against (a) the same model exported with IREE's
own attention (turbine's SDPA lowering, the bottom-right mask materialized) and (b) the model in
torch eager calling a deployed fmha_iree module per layer; with the attention's share of the
embedded model's step (a build calling attention twice per layer, minus the model) beside the
standalone DeviceTensor call of the same shapes.

On the dev machine (compiles the three builds; weights are external parameters):
    python scripts/bench_model.py export --target sm_80 --out DIR
On the GPU machine (only iree-base-runtime, numpy and torch; DIR from above, ATTN a bshd f16 d128
G4 module from `fmha-iree compile --target sm_80 --dtype f16 --hdim 128 --heads 16:4 --layout bshd`):
    python scripts/bench_model.py run --modules DIR --attention-module ATTN [--device cuda://0] [--out OUT]

Each step is timed as a generation loop sees it: the call, then its logits read back (median of
``--reps`` after a warm-up); torch eager likewise with ``torch.cuda.synchronize()``; the standalone
call with ``_timing.device_time``. Writes a table and, with --out, bench.json / bench.csv.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from _timing import device_time, median_time, write_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
BUILDS = ("fmha", "fmha2", "sdpa")
PREFILL, CONTEXT = 2048, 4096


def config(small: bool = False):
    """The benchmark's model; ``small``: a smoke run's (the CPU, f32, short steps)."""
    import torch
    from llama_export import Config

    if small:
        return Config(layers=2, pages=16, page=16)
    return Config(vocab=4096, dim=2048, layers=4, heads=16, kv_heads=4, head_dim=128, hidden=5632, page=64,
                  pages=128, dtype=torch.float16)


def _twice(q, k, v):
    """Attention twice per layer (the second on V halved, so neither call can be dropped)."""
    from fmha_iree.integrations.torch_ops import attention

    return attention(q, k, v, mask="b", layout="bshd") + attention(q, k, v * 0.5, mask="b", layout="bshd")


def export(args):
    import llama_export as ex

    from fmha_iree.integrations.model_export import compile_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, attention in (("fmha", "fmha_iree"), ("fmha2", _twice), ("sdpa", "sdpa")):
        t0 = time.perf_counter()
        cfg = config(args.small)
        prefill = None if args.small else min(PREFILL, cfg.pages * cfg.page // 2)  # a serving bucket (ex.export)
        mlir = ex.export(ex.Decoder(cfg, attention=attention), args.target, external_params=True, prefill_len=prefill)
        t1 = time.perf_counter()
        compile_model(mlir, target=args.target, output=out / f"llama_{name}.vmfb")
        print(f"{name}: export {t1 - t0:.1f} s, compile {time.perf_counter() - t1:.1f} s", flush=True)


def _steps(cfg):
    """(name, tokens, context) of the two steps (at most the cache's rows)."""
    rng = np.random.default_rng(1)
    rows = cfg.pages * cfg.page
    return [("prefill", rng.integers(0, cfg.vocab, (1, min(PREFILL, rows // 2))), np.arange(min(PREFILL, rows // 2))),
            ("decode", rng.integers(0, cfg.vocab, (1, 1)), np.arange(min(CONTEXT, rows)))]


def _measure(row: dict, logits: dict, name: str, fn, reps: int) -> None:
    """``row[name_ms]`` (median of ``reps`` after a warm-up) and ``logits[name]``; a failure is
    recorded as ``row[name_error]`` and printed, and the run goes on."""
    try:
        row[f"{name}_ms"] = median_time(fn, reps) * 1e3
        logits[name] = np.asarray(fn(), np.float32)
        print(f"  {row['step']} {name}: {row[f'{name}_ms']:.3f} ms", flush=True)
    except Exception as e:  # noqa: BLE001 (one peer's failure must not lose the others' figures)
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"  {row['step']} {name}: {row[f'{name}_error']}", flush=True)


def _derived(row: dict, logits: dict, layers: int) -> None:
    """Ratios and agreement from the measured entries present."""
    ms = lambda k: row.get(f"{k}_ms")  # noqa: E731
    if ms("fmha") and ms("fmha2"):
        row["attention_in_model_ms"] = (ms("fmha2") - ms("fmha")) / layers
        row["attention_ratio"] = row["attention_in_model_ms"] / row["standalone_attention_ms"]
    for peer in ("sdpa", "eager_fmha", "eager_sdpa"):
        if ms("fmha") and ms(peer):
            row[f"speedup_vs_{peer}"] = ms(peer) / ms("fmha")
    for b in ("fmha", "sdpa", "eager_fmha"):
        if b in logits and "eager_sdpa" in logits:
            row[f"max_logit_diff_{b}_vs_eager_sdpa"] = float(np.abs(logits[b] - logits["eager_sdpa"]).max())


def _iree_step(mod, dev, tokens, context, cache, table):
    """The step's call on arrays uploaded once to the HAL device ``dev`` (the cache stays there)."""
    import iree.runtime as rt

    args = [rt.asdevicearray(dev, np.ascontiguousarray(x)) for x in
            (np.asarray(tokens, np.int64), np.asarray(context, np.int64), cache, table)]
    fn = mod["prefill" if tokens.shape[1] > 1 else "decode"]
    return lambda: np.asarray(fn(*args)[0].to_host())


def run(args):
    import torch

    import fmha_iree
    import llama_export as ex

    cfg, dev = config(args.small), args.device
    model = ex.Decoder(cfg)
    params = ex.weights(model)
    table = np.random.default_rng(0).permutation(cfg.pages).astype(np.int64)
    dtype = np.float16 if cfg.dtype == torch.float16 else np.float32
    cache = (np.random.default_rng(2).standard_normal(model.new_cache().shape) * 0.1).astype(dtype)
    # --models-device iree: the models on IREE's own device of the URI, opened first (IREE's
    # stream-ordered allocations; fmha_iree's device then keeps them too and warns); fmha: every
    # module on fmha_iree's device (stream-ordered allocations off, released buffers kept).
    # docs/BENCHMARKS.md, "A serving process and the order its devices were opened"
    import iree.runtime as rt

    from fmha_iree.runtime.device import get_device

    hal = rt.get_device(dev) if args.models_device == "iree" else get_device(dev)
    mods = {b: ex.load((Path(args.modules) / f"llama_{b}.vmfb").read_bytes(), hal, params) for b in BUILDS}
    attn = fmha_iree.load(args.attention_module, device=dev)
    cuda = torch.device("cuda" if dev.startswith("cuda") else "cpu")
    sync = torch.cuda.synchronize if cuda.type == "cuda" else (lambda: None)
    eager = {"eager_fmha": ex.Decoder(cfg, attention=lambda q, k, v: attn(q, k, v, mask="b")).to(cuda),
             "eager_sdpa": ex.Decoder(cfg, attention="sdpa").to(cuda)}
    rows = []
    for step, tokens, context in _steps(cfg):
        row = dict(step=step, tokens=int(tokens.shape[1]), context=int(len(context)))
        logits = {}
        for b, mod in mods.items():
            fn = _iree_step(mod, hal, tokens, context, cache, table)
            _measure(row, logits, b, fn, args.reps)
        targs = (torch.from_numpy(tokens).to(cuda), torch.from_numpy(context).to(cuda),
                 torch.from_numpy(cache).to(cuda), torch.from_numpy(table).to(cuda))
        for name, m in eager.items():
            def call(m=m):
                with torch.no_grad():
                    out = m.step(*targs)[0]
                sync()
                return out
            _measure(row, logits, name, lambda call=call: call().cpu().numpy(), args.reps)
        q = fmha_iree.to_device(np.random.default_rng(3).standard_normal((1, len(tokens[0]), cfg.heads, cfg.head_dim))
                                .astype(dtype), dev)
        kv = [fmha_iree.to_device(np.random.default_rng(4 + i).standard_normal(
            (1, len(context), cfg.kv_heads, cfg.head_dim)).astype(dtype), dev) for i in range(2)]
        row["standalone_attention_ms"] = device_time(lambda: attn(q, *kv, mask="b"), args.reps) * 1e3
        _derived(row, logits, cfg.layers)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    if args.out:
        write_rows(args.out, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--target", default="sm_80")
    e.add_argument("--out", required=True)
    e.add_argument("--small", action="store_true", help="a small f32 model, for a smoke run on the CPU")
    r = sub.add_parser("run")
    r.add_argument("--modules", required=True)
    r.add_argument("--attention-module", required=True)
    r.add_argument("--device", default="cuda://0")
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--out")
    r.add_argument("--small", action="store_true", help="the small model of export --small")
    r.add_argument("--models-device", choices=("fmha", "iree"), default="fmha",
                   help="the models on fmha_iree's device (default) or on IREE's own, opened first")
    args = ap.parse_args()
    export(args) if args.cmd == "export" else run(args)


if __name__ == "__main__":
    main()
