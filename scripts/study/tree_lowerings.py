"""Study at commit 533343d: the causal tree's ops at other lowerings, as sm_80 modules (S = 2048, 4096)
to profile on the H200 with causal_profile.py ($FMHA_PROFILE_MODULE=DIR/<variant>.vmfb).

  tree_lowerings.py DIR [VARIANT...]   (here; $FMHA_STUDY_DTYPE: bf16 for bf16 modules)

A variant maps op-name prefixes ("dg": the masked diagonal (both halves when split), "lv": every level, "lv0".."lv3": one
level) to lowering fields replacing those the package gives that op (after diag_lowering for the
diagonal). The f16 d128 package lowering: levels M256 / K2=32 / 8 warps, diagonal M128 / K2=32 /
4 warps. The variants split / padmerge / padmerge_split need `git apply scripts/study/diag_split.patch`
(render_causal_tree's `split` and `merge_pad`, not kept; docs/BENCHMARKS.md, commit 533343d).
"""
import sys

from fmha_iree import mlir_templates as mt

M128 = {"workgroup_m": 128, "subgroups_m": 4, "workgroup_size": 128}
VARIANTS = {
    "base": {},
    "l128k32": {"lv": M128},
    "l128k64": {"lv": {**M128, "reduction_k2": 64}},
    "l256k64": {"lv": {"reduction_k2": 64}},
    "d128k64": {"dg": {"reduction_k2": 64}},
    "d64k32": {"dg": {"workgroup_m": 64, "subgroups_m": 2, "workgroup_size": 64}},
    # with the diagonal split into halves of rows (render_causal_tree's `split`, on by default
    # after the variants above were built): the package as is
    "split": {},
    # the merge reading each level's partial once: padded to the rows of t_j = 0 (merge_pad), the
    # pads fused into the merge by iree-compile's flag below; diagonal whole
    "padmerge": {"tree": {"merge_pad": True, "split": False},
                 "flags": ["--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops"]},
    "padmerge_split": {"tree": {"merge_pad": True, "split": True},
                       "flags": ["--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops"]},
    # each op's acc partial normalized (acc / sum in the input type) by a consumer of the kind
    # IREE's own attention gets, max and sum kept (`git apply scripts/study/normalized_consumer.patch`):
    # the op then has more than one consumer, which IREE 3.13 fuses only with aggressive fusion,
    # and that flag broke other dispatches of the module (norm: no module); without it the
    # normalizations became their own dispatch (norm_noflag: built, not timed)
    "norm": {"tree": {"normalize": True}, "flags": ["--iree-dispatch-creation-enable-aggressive-fusion"]},
    "norm_noflag": {"tree": {"normalize": True}},
    # IREE's shared-memory prefetch (software pipelining of the K2 loop), every tree op; last
    # measured in commit 30b39b7, before the native exp2, when the kernels were ALU-bound
    "pf2": {"lv": {"prefetch_stages": 2}, "dg": {"prefetch_stages": 2}},
    "pf3": {"lv": {"prefetch_stages": 3}, "dg": {"prefetch_stages": 3}},
    # the same through iree-compile's flag (every dispatch of the module)
    "gpf2": {"flags": ["--iree-llvmgpu-prefetch-num-stages=2"]},
}


def patch(v: dict):
    """Apply variant `v` ("tree": render_causal_tree arguments, "flags": extra iree-compile flags,
    other keys: op-name prefixes); returns the undo."""
    from fmha_iree import compile as fc

    orig, orig_tree, orig_flags = mt._attn_op_vt, mt.render_causal_tree, fc.ASYNC_FLAGS
    ops = {k: x for k, x in v.items() if k not in ("tree", "flags")}

    def op(name, *a, lowering=None, **k):
        for prefix in sorted(ops, key=len):  # "lv" first, then "lv0" etc. on top
            if name.startswith(prefix):
                lowering = dict(lowering, **ops[prefix])
        return orig(name, *a, lowering=lowering, **k)

    mt._attn_op_vt = op
    if v.get("tree"):
        mt.render_causal_tree = lambda **k: orig_tree(**{**k, **v["tree"]})
    fc.ASYNC_FLAGS = list(orig_flags) + list(v.get("flags", ()))
    return lambda: (setattr(mt, "_attn_op_vt", orig), setattr(mt, "render_causal_tree", orig_tree),
                    setattr(fc, "ASYNC_FLAGS", orig_flags))


if __name__ == "__main__":
    from tree_op_tiles import build  # same folder (run as scripts/study/tree_lowerings.py)

    build(sys.argv[1:], VARIANTS, patch)
