"""A whole torch model with fmha_iree attention inside, exported and compiled as ONE IREE module:
no Python and no second module per attention call.

    import fmha_iree.integrations.model_export as mx
    mlir = mx.export_model(model, (x,), target="host", dynamic_shapes=...)   # or an FxProgramsBuilder
    mx.compile_model(mlir, target="host", output="model.vmfb")               # + model.json

The model calls ``torch.ops.fmha_iree.fmha_fwd`` (``fmha_iree.sdpa``, the transformers backend, or
the op itself); ``iree.turbine.aot.export`` traces it, and every call is expanded into fmha_iree's
kernel for ``target`` (``model_op``). Eager calls of the same model still run through fmha_iree's
own modules. ``model_compile_flags(target)`` gives the flags a model compile needs; on CUDA,
:func:`compile_model` also applies fmha_iree's native-exp2 PTX step.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..problem.targets import Target

__all__ = ["export_model", "compile_model", "model_compile_flags", "check_target"]

_DTYPES = ("f16", "bf16", "f32")


def check_target(target) -> Target:
    """``target`` as a :class:`Target` (``host``, ``gfx942``, ``sm_80``, ...), or ValueError naming it."""
    if isinstance(target, Target):
        return target
    if not isinstance(target, str):
        raise TypeError(f"target must be a target name such as 'host', 'gfx942' or 'sm_80', got {type(target).__name__}")
    try:
        return Target.from_name(target)
    except (ValueError, KeyError) as e:
        raise ValueError(f"target {target!r} is not a compile target fmha_iree knows: {e}") from None


def model_compile_flags(target) -> list[str]:
    """The iree-compile flags of a model with fmha_iree kernels inside, for ``target``: the target's
    own; on the CPU the lifted check against large vectors (the unit loop's tiles exceed it on
    AVX2 hosts); on CUDA the bindings flag fmha_iree's CUDA modules are built with. IREE's default
    execution model is kept (fmha_iree's own modules take fences from its runtime; a model is
    called through ``iree.runtime``'s plain function calls)."""
    from ..toolchain.compile import CUDA_FLAGS

    t = check_target(target)
    flags = t.compile_flags() + ["--iree-input-type=auto"]
    if t.backend == "llvm-cpu":
        return flags + ["--iree-llvmcpu-fail-on-large-vector=false"]
    return flags + (CUDA_FLAGS if t.backend == "cuda" else [])


def export_model(model, args=(), *, target, kwargs=None, dynamic_shapes=None, function_name="main",
                 strict_export: bool = True) -> str:
    """The MLIR (torch input dialect, fmha_iree's calls expanded) of ``model`` exported with
    ``iree.turbine.aot.export``: an ``nn.Module`` with example ``args`` / ``kwargs`` /
    ``dynamic_shapes`` (as ``torch.export.export`` takes them), or an ``aot.FxProgramsBuilder``
    holding several entry points (prefill and decode). ``target`` names the kernels' target."""
    t = check_target(target)
    from iree.turbine import aot
    from iree.turbine.transforms.general.custom_op_expansion import ExpandCustomOpsPass

    from . import torch_ops
    from .model_op import expanders
    from .turbine_shims import apply

    del torch_ops  # imported for its registration of torch.ops.fmha_iree.*

    apply()
    try:
        if isinstance(model, aot.FxProgramsBuilder):
            exported = aot.export(model)
        else:
            exported = aot.export(model, args=tuple(args), kwargs=kwargs, dynamic_shapes=dynamic_shapes,
                                  function_name=function_name, strict_export=strict_export)
    except Exception as e:
        raise _argument_error(e) or e
    module_op = exported.mlir_module
    ExpandCustomOpsPass(module_op, reg=expanders(t)).run()
    text = str(module_op)
    if "torch.fmha_iree." in text:
        raise ValueError("a call of a fmha_iree op was left unexpanded (torch.ops.fmha_iree.fmha_fwd and "
                         "fmha_fwd_varlen are expanded inside a model)")
    return text


def _argument_error(e: BaseException) -> ValueError | TypeError | None:
    """The ValueError / TypeError an fmha_iree op's checks raised under tracing, which torch's
    export wraps in its own errors: the user sees the message naming the argument."""
    import ast
    import re

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e) in (ValueError, TypeError):
            return e
        # raised inside code Dynamo traces (strict export), the error arrives as Dynamo's
        # "observed" exception whose message quotes it
        found = re.match(r"raised exception (ValueError|TypeError)\((.*)\)$", str(e).split("\n")[0])
        if found and type(e).__name__.startswith("Observed"):
            try:
                message = ast.literal_eval(found.group(2))
            except (ValueError, SyntaxError):
                message = found.group(2)
            return (ValueError if found.group(1) == "ValueError" else TypeError)(message)
        e = e.__cause__ or e.__context__
    return None


def compile_model(mlir: str, *, target, output, extra_flags=()) -> dict:
    """Compile ``mlir`` (from :func:`export_model`) for ``target`` into ``output`` (``.vmfb``) and
    write a manifest beside it (``.json``: target, flags, toolchain, the module's functions; for gfx
    targets the ISA report of every kernel, as ``fmha-iree compile`` writes it). Returns the
    manifest. A GPU module the runtime would refuse to load (``isa.dispatch_limits``) is a
    RuntimeError."""
    import tempfile

    import iree.compiler.tools as ict

    from ..toolchain.compile import compile_native_exp2, toolchain
    from ..toolchain.isa import dispatch_limits, isa_report

    t = check_target(target)
    flags = model_compile_flags(t) + list(extra_flags)
    out = Path(output)
    with tempfile.TemporaryDirectory(prefix="fmha_iree_model_") as dump:
        dumped = [f"--iree-hal-dump-executable-files-to={dump}"] if t.backend != "llvm-cpu" else []
        if t.backend == "cuda":
            vmfb, exp2 = compile_native_exp2(mlir, flags + dumped)
        else:
            vmfb, exp2 = ict.compile_str(mlir, extra_args=flags + dumped), None
        isa = isa_report(dump, t.arch) if t.backend == "rocm" else None
        over = dispatch_limits(dump) if dumped else []
    if over:
        raise RuntimeError(f"IREE's GPU runtime would refuse to load the model: {'; '.join(over[:4])}")
    out.write_bytes(vmfb)
    manifest = {"format": "fmha_iree.model/1", "target": t.name, "backend": t.backend, "flags": flags,
                "native_exp2": exp2, "toolchain": toolchain(), "functions": _functions(mlir), "isa": isa}
    out.with_suffix(".json").write_text(json.dumps(manifest, indent=2))
    return manifest


def _functions(mlir: str) -> list[str]:
    """The public functions of the exported module (its entry points)."""
    import re

    return sorted(set(re.findall(r"func\.func @(\w+)\(", mlir)))  # private ones read "func.func private @"
