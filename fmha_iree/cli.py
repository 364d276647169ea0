"""``fmha-iree``: compile deployable FMHA modules for gfx, CUDA and CPU targets.

    fmha-iree compile --target gfx942 --dtype f16 --hdim 128 --heads 32:8 --mask b -o out/fmha.vmfb

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


def compile_main(args) -> int:
    from .compile import build_artifact
    from .mask import Mask
    from .spec import KernelSpec, check_head_dims
    from .targets import Target
    from .tiles import default_tiles, parse_tiles

    try:
        target = Target.from_name(args.target)
        dv = args.hdim_v or args.hdim
        check_head_dims(args.hdim, dv)
        mask = Mask.from_str(args.mask)
        tiles = parse_tiles(args.tiles) if args.tiles else default_tiles(target.family, args.hdim, dv)
    except (ValueError, TypeError) as e:
        print(f"fmha-iree compile: {e}", file=sys.stderr)
        return 2
    hq, hk = args.heads
    spec = KernelSpec(args.dtype, args.layout, hq // hk, args.hdim, dv, tiles, target)
    problem = {"heads": hq, "kv_heads": hk, "mask": str(mask), "lse": args.lse} if args.heads_given else {
        "mask": str(mask), "lse": args.lse}
    manifest = build_artifact(spec, args.output, dump_dir=args.dump, problem=problem)
    isa = manifest["isa"] or []
    spills = sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in isa)
    print(f"{args.output}: {spec.module_name} ({target.backend} {target.arch}), tiles {tiles.ck_name}"
          + (f", {len(isa)} kernels, {spills} spills" if isa else ""))
    if args.verbose:
        print(json.dumps(manifest, indent=2))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fmha-iree", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile one module (.vmfb + .json manifest)")
    c.add_argument("--target", required=True, help="host, gfx90a, gfx942, gfx950, gfx1100, gfx1201 (or mi300x, ...), sm_80")
    c.add_argument("--dtype", choices=("f16", "bf16", "f32"), required=True)
    c.add_argument("--hdim", type=int, required=True, help="Q/K head dim")
    c.add_argument("--hdim-v", type=int, help="V head dim (default: --hdim)")
    c.add_argument("--heads", type=_heads, default=None, help="HQ[:HK]; only their ratio specializes the module")
    c.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    c.add_argument("--mask", default="0", help="default mask of the module (CK string)")
    c.add_argument("--lse", action="store_true", help="record that callers want LSE (every module can return it)")
    c.add_argument("--tiles", help="m0xn0xk0xn1xk1[:kv_chunk], CK's bm0xbn0xbk0xbn1xbk1")
    c.add_argument("--dump", help="also keep IREE's dumped executables (configured IR, ISA) here")
    c.add_argument("-o", "--output", required=True, help="output .vmfb (the manifest goes beside it as .json)")
    c.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    args.heads_given = args.heads is not None
    if args.heads is None:
        args.heads = (1, 1)
    if args.cmd == "compile":
        return compile_main(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
