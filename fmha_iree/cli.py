"""``fmha-iree``: compile deployable FMHA modules for gfx, CUDA and CPU targets.

    fmha-iree compile --target gfx942 --dtype f16 --hdim 128 --heads 32:8 --mask b -o out/fmha.vmfb
    fmha-iree link-module --target gfx942 --dtype f16 --hdim 128 --heads 32:8 --layout bshd -o attn.mlir

Batch size and sequence lengths are runtime values of every module; the mask given here becomes
the default of the loaded module (any mask works at run time).
"""

from __future__ import annotations

import argparse
import json
import sys


def _heads(text: str) -> tuple[int, int]:
    hq, _, hk = text.partition(":")
    try:
        hq_i, hk_i = int(hq), int(hk or hq)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: expected HQ or HQ:HK") from None
    if hq_i <= 0 or hk_i <= 0 or hq_i % hk_i:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: HQ must be a positive multiple of HK")
    return hq_i, hk_i


def _seqlens(text: str) -> tuple:
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seqlens {text!r}: expected comma-separated integers") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"--seqlens {text!r}: lengths must be positive")
    return vals


def compile_main(args) -> int:
    from .toolchain.compile import build_artifact
    from .problem.mask import Mask
    from .problem.spec import KernelSpec, check_head_dims, check_softcap, check_tiles
    from .problem.targets import Target
    from .problem.tiles import parse_tiles

    try:
        target = Target.from_name(args.target)
        dv = args.hdim_v or args.hdim
        check_head_dims(args.hdim, dv)
        mask = Mask.from_str(args.mask)
        tiles = parse_tiles(args.tiles) if args.tiles else None
        tiles = check_tiles(tiles, target, args.hdim, dv, args.dtype)
        hq, hk = args.heads
        pinned = (0, 0)
        if target.backend == "llvm-cpu" and args.seqlens:
            # the CPU's compiled-in entries are fast only with static batch and heads too
            pinned = (args.batch or 0, hk if args.heads_given else 0)
        elif args.batch:
            raise ValueError("--batch: only the CPU's compiled-in (--seqlens) entries are specialized on the batch")
        if args.alibi and (hq != hk or args.seqlens):
            raise ValueError("--alibi: one query head per KV head (--heads H:H) and no --seqlens (fwd_tiles alone)")
        if args.bias and (args.alibi or args.seqlens):
            raise ValueError("--bias: not with --alibi (one bias kind a module, as CK's) nor --seqlens (fwd_tiles alone)")
        spec = KernelSpec(args.dtype, args.layout, hq // hk, args.hdim, dv, tiles, target, tuple(args.seqlens), *pinned,
                          softcap=check_softcap(args.softcap), alibi=args.alibi, bias=args.bias)
        if spec.seqlens:
            from .codegen.source import dense_params

            if not dense_params(spec):  # also checks each length against the module's alignment
                raise ValueError(f"--seqlens: target {target.arch} {args.dtype} d{args.hdim} has no one-call "
                                 "entry points to specialize (IREE picks its config, or Dv is split)")
    except (ValueError, TypeError) as e:
        print(f"fmha-iree compile: {e}", file=sys.stderr)
        return 2
    problem = {"heads": hq, "kv_heads": hk, "mask": str(mask), "lse": args.lse} if args.heads_given else {
        "mask": str(mask), "lse": args.lse}
    try:
        manifest = build_artifact(spec, args.output, dump_dir=args.dump, problem=problem,
                                  native_exp2=False if args.iree_exp2 else None)
    except RuntimeError as e:  # a module IREE's runtime would refuse to load (isa.dispatch_limits)
        print(f"fmha-iree compile: {e}", file=sys.stderr)
        return 1
    isa = manifest["isa"] or []
    spills = sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in isa)
    print(f"{args.output}: {spec.module_name} ({target.backend} {target.arch}), tiles {tiles.ck_name}"
          + (f", {len(isa)} kernels, {spills} spills" if isa else ""))
    if args.verbose:
        print(json.dumps(manifest, indent=2))
    return 0


def compile_matrix(out_dir, targets, hdims, dtypes, *, layout="bhsd", group=1, jobs=2, progress=True,
                   keep_dumps=False) -> list[dict]:
    """Compile the default config of every target x head dim x dtype into ``out_dir`` (one
    ``.vmfb`` + ``.json`` each, named after the module) and write ``matrix.json`` summarizing them.
    Masks are runtime values, so one module per entry serves every mask kind."""
    import concurrent.futures as cf
    import time
    from pathlib import Path

    from .toolchain.compile import build_artifact
    from .codegen.source import source_mlir
    from .problem.spec import KernelSpec, check_tiles
    from .problem.targets import Target

    out_dir = Path(out_dir)
    specs = []
    refused = []
    for t in targets:
        target = Target.from_name(t)
        for d in hdims:
            for dt in dtypes:
                try:
                    tiles = check_tiles(None, target, d, d, dt)
                except ValueError as e:  # a combination this target cannot run: say why
                    refused.append({"module": None, "target": target.arch, "dtype": dt, "hdim": d, "tiles": None,
                                    "ok": False, "refused": str(e)})
                    continue
                specs.append(KernelSpec(dt, layout, group, d, d, tiles, target))
    for spec in specs:  # torch export is not thread-safe: export (cached) serially first
        source_mlir(spec)
    rows, done, t0 = [], 0, time.time()

    def one(spec):
        try:
            dump = out_dir / "dumps" / spec.module_name if keep_dumps else None
            man = build_artifact(spec, out_dir / f"{spec.module_name}.vmfb", dump_dir=dump, problem={"mask": "any (runtime)"})
            isa = man["isa"] or []
            return {"module": spec.module_name, "target": spec.target.arch, "dtype": spec.dtype, "hdim": spec.dq,
                    "tiles": spec.tiles.ck_name, "ok": True,
                    "spills": sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in isa) if isa else None,
                    "max_vgpr": max((k["vgpr_count"] for k in isa), default=None),
                    "max_lds": max((k["group_segment_fixed_size"] for k in isa), default=None),
                    "min_occupancy": min((k["occupancy_waves_per_simd"] for k in isa if k["mfma_count"] + k["wmma_count"]), default=None)}
        except Exception as e:  # report every failure, keep compiling the rest
            return {"module": spec.module_name, "target": spec.target.arch, "dtype": spec.dtype, "hdim": spec.dq,
                    "tiles": spec.tiles.ck_name, "ok": False, "error": str(e).splitlines()[-1][:300] if str(e) else repr(e)}

    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for row in pool.map(one, specs):
            rows.append(row)
            done += 1
            if progress:
                bar = "#" * (30 * done // len(specs))
                print(f"\r[{bar:<30}] {done}/{len(specs)} {time.time() - t0:5.0f}s {row['module'][:60]:<60}",
                      end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    rows += refused
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "matrix.json").write_text(json.dumps(rows, indent=2))
    return rows


def matrix_main(args) -> int:
    rows = compile_matrix(args.output, args.targets.split(","), [int(d) for d in args.hdims.split(",")],
                          args.dtypes.split(","), layout=args.layout, jobs=args.jobs)
    bad = [r for r in rows if (not r["ok"] and "refused" not in r) or r.get("spills")]
    for r in rows:
        print(f"{r['target']:<8}{r['dtype']:<5}d{r['hdim']:<4}{r['tiles'] or '-':<22}"
              + (f"ok  spills={r['spills']} vgpr={r['max_vgpr']} lds={r['max_lds']} occ={r['min_occupancy']}" if r["ok"]
                 else f"REFUSED {r['refused']}" if "refused" in r else f"FAILED {r['error']}"))
    print(f"{len(rows) - len(bad)}/{len(rows)} compiled without spills into {args.output}")
    return 1 if bad else 0


def info_main(args) -> int:
    """Print a module's manifest in short: problem, target, tiles, entry points, ISA figures."""
    from pathlib import Path

    path = Path(args.module)
    try:
        man = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError) as e:
        print(f"fmha-iree info: cannot read the manifest of {path}: {e}", file=sys.stderr)
        return 2
    pr, tg, ck = man.get("problem", {}), man.get("target", {}), man.get("tiles", {}).get("ck", {})
    print(f"module   {man.get('module')}  ({man.get('format')}, sha256 {str(man.get('sha256'))[:16]})")
    print(f"target   {tg.get('backend')} {tg.get('name')}  (family {tg.get('family')})")
    print("problem  " + ", ".join(f"{k}={v}" for k, v in pr.items()))
    print("tiles    " + " ".join(f"{k}={v}" for k, v in ck.items()) + f"  kv_chunk={man.get('tiles', {}).get('kv_chunk')}")
    tc = man.get("toolchain", {})
    print("compiler " + ", ".join(f"{k} {v}" for k, v in tc.items() if isinstance(v, str)))
    print("entries")
    for name, e in man.get("entry_points", {}).items():
        args_ = ", ".join(f"{a}[{', '.join(map(str, shape))}]" for a, (shape, _) in e.get("args", {}).items())
        print(f"  {name}({args_})" + (f"  -- {e['note']}" if e.get("note") else ""))
    for k in man.get("isa") or []:
        print(f"isa      {k['kernel']}: vgpr {k['vgpr_count']} agpr {k['agpr_count']} sgpr {k['sgpr_count']} "
              f"spills {k['vgpr_spill_count'] + k['sgpr_spill_count']} lds {k['group_segment_fixed_size']} "
              f"mfma {k['mfma_count']} wmma {k['wmma_count']} waves/simd {k['occupancy_waves_per_simd']}")
    return 0


def link_main(args) -> int:
    """``link-module``: the attention function as MLIR for ``iree-link`` (docs/model-export.md)."""
    from .codegen.link import declaration, link_module
    from .problem.spec import KernelSpec, check_head_dims, check_tiles
    from .problem.targets import Target

    try:
        target = Target.from_name(args.target)
        dv = args.hdim_v or args.hdim
        check_head_dims(args.hdim, dv)
        hq, hk = args.heads
        spec = KernelSpec(args.dtype, args.layout, hq // hk, args.hdim, dv,
                          check_tiles(None, target, args.hdim, dv, args.dtype), target)
        text = link_module(spec)
    except (ValueError, TypeError) as e:
        print(f"fmha-iree link-module: {e}", file=sys.stderr)
        return 2
    with open(args.output, "w") as f:
        f.write(text)
    print(f"{args.output}: module @fmha_iree, function @attention for {target.arch}; declare it as\n  "
          + declaration(text, "attention", "fmha_iree.attention"))
    return 0


def _kernel_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments that specialize a kernel (compile, link-module)."""
    p.add_argument("--target", required=True, help="host, gfx90a, gfx942, gfx950, gfx1100, gfx1201 (or mi300x, ...), sm_80")
    p.add_argument("--dtype", choices=("f16", "bf16", "f32"), required=True)
    p.add_argument("--hdim", type=int, required=True, help="Q/K head dim")
    p.add_argument("--hdim-v", type=int, help="V head dim (default: --hdim)")
    p.add_argument("--heads", type=_heads, default=None, help="HQ[:HK]; only their ratio specializes the module")
    p.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fmha-iree", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = _kernel_args(sub.add_parser("compile", help="compile one module (.vmfb + .json manifest)"))
    c.add_argument("--mask", default="0", help="default mask of the module (CK string)")
    c.add_argument("--lse", action="store_true", help="record that callers want LSE (every module can return it)")
    c.add_argument("--tiles", help="m0xn0xk0xn1xk1[:kv_chunk], CK's bm0xbn0xbk0xbn1xbk1")
    c.add_argument("--seqlens", type=_seqlens, default=(),
                   help="S1,S2,...: also compile entry points specialized on Sq == Sk == S (GPU: causal "
                        "tree and fused out-only ops; CPU: row blocks, also fixed to --batch and --heads "
                        "when given); other shapes still run")
    c.add_argument("--batch", type=int, default=0, help="with --seqlens on the CPU: the batch size they take")
    c.add_argument("--softcap", type=float, default=None,
                   help="logits soft-cap compiled into every kernel (softcap * tanh(s / softcap); Gemma 2: 50)")
    c.add_argument("--alibi", action="store_true",
                   help="ALiBi: fwd_tiles alone, the slopes an argument of every call (BLOOM, MPT; Hq == Hk)")
    c.add_argument("--bias", action="store_true",
                   help="an elementwise bias [B, Hq, Sq, Sk] (broadcastable) an argument of every call: fwd_tiles alone")
    c.add_argument("--iree-exp2", action="store_true",
                   help="CUDA: keep IREE's polynomial exp2 (default: ex2.approx, see fmha_iree/toolchain/ptx.py)")
    c.add_argument("--dump", help="also keep IREE's dumped executables (configured IR, ISA) here")
    c.add_argument("-o", "--output", required=True, help="output .vmfb (the manifest goes beside it as .json)")
    c.add_argument("-v", "--verbose", action="store_true")
    mx = sub.add_parser("matrix", help="compile the default config of targets x head dims x dtypes into one folder")
    mx.add_argument("--targets", default="gfx90a,gfx942,gfx950,gfx1100,gfx1201,sm_80,host")
    mx.add_argument("--hdims", default="32,64,96,128,192,256")
    mx.add_argument("--dtypes", default="f16,bf16,f32")
    mx.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    mx.add_argument("--jobs", type=int, default=2, help="parallel iree-compile processes")
    mx.add_argument("-o", "--output", required=True, help="output folder")
    lm = _kernel_args(sub.add_parser("link-module", help="write the attention function as an MLIR module for iree-link"))
    lm.add_argument("-o", "--output", required=True, help="output .mlir")
    inf = sub.add_parser("info", help="print a module's manifest in short (target, tiles, entry points, ISA)")
    inf.add_argument("module", help="a .vmfb written by fmha-iree compile (its .json beside it)")
    args = ap.parse_args(argv)
    if args.cmd == "matrix":
        return matrix_main(args)
    if args.cmd == "info":
        return info_main(args)
    args.heads_given = args.heads is not None
    if args.heads is None:
        args.heads = (1, 1)
    if args.cmd == "compile":
        return compile_main(args)
    if args.cmd == "link-module":
        return link_main(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
