#!/usr/bin/env python3
"""Repro: IREE 3.13 (llvm-cpu) miscompiles fmha_iree's ``units`` kernel inlined into a model when
the call site's sizes are static with B * Hk = 1 and G = Hq / Hk > 1 (docs/model-export.md).

    python docs/repro/unit_batch_miscompile.py

Exports a one-call model (q [1, 33, 4, 64], k / v [1, 70, 1, 64], mask ``b``, every size static)
twice: as fmha_iree exports it (the wrapper passes q, k and v through a
``util.optimization_barrier`` and ties them to their sizes passed through another, so the kernel
sees every size dynamic) and with those barriers taken out (each tensor cast to itself and tied to
its own sizes: the static sizes then reach the kernel). Prints each build's largest difference from
a float64 reference.
"""

import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import iree.compiler.tools as ict  # noqa: E402
import iree.runtime as rt  # noqa: E402
from reference import attention_ref  # noqa: E402

from fmha_iree.integrations.model_export import export_model, model_compile_flags  # noqa: E402
from fmha_iree.integrations.torch_ops import attention  # noqa: E402


class One(torch.nn.Module):
    def forward(self, q, k, v):
        return attention(q, k, v, mask="b", layout="bshd")


def _bare(text: str) -> str:
    """A wrapper's text with the barriers on q, k, v taken out: each tensor cast to itself and tied
    to its own sizes."""
    text = re.sub(r"(%\w)o = util\.optimization_barrier (%\wd) : (tensor<[^>]*>)", r"\1o = tensor.cast \2 : \3 to \3",
                  text)
    return re.sub(r"(flow\.tensor\.tie_shape %(\w)o : tensor<[^>]*>)\{[^}]*\}",
                  lambda m: m.group(1) + "{" + ", ".join(f"%{m.group(2)}s{i}" for i in range(3)) + "}", text)


def _export_bare(q, k, v) -> str:
    """The model exported with ``_bare`` wrappers (model_op's wrapper text rewritten)."""
    from fmha_iree.integrations import model_op

    own = model_op._wrapper_text
    model_op._wrapper_text = lambda *a: _bare(own(*a))
    try:
        return export_model(One(), (q, k, v), target="host")
    finally:
        model_op._wrapper_text = own


def run(mlir: str, q, k, v) -> np.ndarray:
    vmfb = ict.compile_str(mlir, extra_args=model_compile_flags("host"))
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    return np.asarray(ctx.modules.module["main"](q.numpy(), k.numpy(), v.numpy()).to_host())


def main():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 33, 4, 64, generator=g), torch.randn(1, 70, 1, 64, generator=g), torch.randn(
        1, 70, 1, 64, generator=g)
    mlir = export_model(One(), (q, k, v), target="host")
    bare = _export_bare(q, k, v)
    assert bare != mlir
    ref, _ = attention_ref(q, k, v, mask="b", layout="bshd")
    for name, text in (("sizes behind the barrier", mlir), ("static sizes reach the kernel", bare)):
        print(f"{name}: max |out - ref| = {np.abs(run(text, q, k, v) - ref).max():.3g}")


if __name__ == "__main__":
    main()
