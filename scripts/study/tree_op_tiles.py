"""Study at commit 59a747a: variants of the causal tree's ops and of V's transpose, as f16 d128 sm_80
modules (S = 2048, 4096) to profile on the H200 with causal_profile.py.

  tree_op_tiles.py DIR [VARIANT...]   (here: writes DIR/<variant>.vmfb and .json;
                                       $FMHA_STUDY_DTYPE: bf16 for bf16 modules, named <variant>_bf16)

Variants (the first four before t8 and dg128a landed): base (as on main); t8 (the transpose's threads write 8 elements, [4, 32, 1]: 0.12
against 0.18 ms in transpose_tiles.py); dg128a / dg128b (the masked diagonal op at 128 rows per
workgroup, 4 / 8 subgroups, instead of 256).
"""
import os
import sys
from pathlib import Path

from fmha_iree import cli
from fmha_iree import mlir_templates as mt

VARIANTS = {
    "base": {},
    "t8": {"t8": True},
    "dg128a": {"dg": {"workgroup_m": 128, "subgroups_m": 4}},
    "dg128b": {"dg": {"workgroup_m": 128, "subgroups_m": 8}},
    # after t8 and dg128a landed (main): the levels of 256 and 512 keys at 128 rows, 4 subgroups
    "lv128": {"lv": ("lv0", "lv1"), "dg": None},
    # bf16 d128 tiles (128 rows, 4 subgroups; diag_lowering leaves them): the diagonal at 64 rows
    "dg64": {"dg": {"workgroup_m": 64, "subgroups_m": 2}},
}


def patch(v: dict):
    orig_op, orig_t = mt._attn_op_vt, mt._transpose_copy

    def op(name, *a, lowering=None, **k):
        if name == "dg" and v.get("dg"):
            lowering = dict(lowering, **v["dg"])
        if name in v.get("lv", ()):
            lowering = mt.diag_lowering(lowering)
        return orig_op(name, *a, lowering=lowering, **k)

    def tr(*a, **k):
        text = orig_t(*a, **k)
        if v.get("t8"):
            text = text.replace("thread = [1, 4, 1]", "thread = [1, 8, 1]").replace("workgroup_size = [8, 32, 1]", "workgroup_size = [4, 32, 1]")
        return text

    mt._attn_op_vt, mt._transpose_copy = op, tr
    return lambda: (setattr(mt, "_attn_op_vt", orig_op), setattr(mt, "_transpose_copy", orig_t))


def build(argv: list[str], variants: dict, patch) -> None:
    """`argv` = [DIR, VARIANT...]: one f16 (or $FMHA_STUDY_DTYPE) d128 sm_80 module, S = 2048 and
    4096, per variant, built with `patch(variant)` in force (also tree_lowerings.py's driver)."""
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    dtype = os.environ.get("FMHA_STUDY_DTYPE", "f16")
    for name in argv[1:] or variants:
        undo = patch(variants[name])
        try:
            cli.main(["compile", "--target", "sm_80", "--dtype", dtype, "--hdim", "128", "--heads", "16:16",
                      "--seqlens", "2048,4096", "-o", str(out / f"{name}{'' if dtype == 'f16' else '_' + dtype}.vmfb")])
        finally:
            undo()
        print("built", name, flush=True)


if __name__ == "__main__":
    build(sys.argv[1:], VARIANTS, patch)
