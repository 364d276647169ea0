"""The package's layers: its folders are its wings (runtime, problem, paths, codegen, toolchain,
integrations; the public API at the top), and every module imports only modules of lower layers
(or, inside a package of kernels or templates, its siblings), at the top of the file or inside a
function; so there is no import circle, and importing a low layer loads nothing above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fmha_iree

PKG = Path(fmha_iree.__file__).resolve().parent

# Lowest first, wing by wing. A module may import any module of an earlier layer.
LAYERS = [
    # runtime: IREE devices and arrays, a loaded module's functions (knows no paths, no code generation)
    ["runtime.allocation"], ["runtime.device"], ["runtime.staging", "runtime.torch_gpu", "runtime.prepared"],
    ["runtime.module"],
    # problem: what a caller asks for, and the ABI every wing shares
    ["problem.abi", "problem.targets", "problem.mask", "problem.operand"], ["problem.tiles", "problem.alibi", "problem.bias", "problem.fp8"], ["problem.spec", "problem.plan"],
    ["problem.paged"],
    # paths: selection and each path's host side
    ["paths"],
    # codegen: a module's functions as MLIR, the manifest's entry points
    ["codegen.torch_abi"], ["codegen.rows"], ["codegen.graph", "codegen.mlir_templates"],
    ["codegen.kernels", "codegen.source_cpu", "codegen.wrappers"], ["codegen.source"], ["codegen.entries", "codegen.link"],
    # toolchain: iree-compile, caches, ISA reports
    ["toolchain.cache", "toolchain.isa", "toolchain.ptx"], ["toolchain.compile"],
    # the public API
    ["api", "deploy"], ["cli", "demo"],
    # integrations (model_op / model_export: fmha_iree's kernels inside an exported model)
    ["integrations.turbine_shims"], ["integrations.torch_ops", "integrations.distributed_args", "integrations.model_op"],
    ["integrations.hf_masks"], ["integrations.hf", "integrations.distributed", "integrations.model_export"],
    ["__init__"],
]
WINGS = ("runtime", "problem", "codegen", "toolchain", "integrations")
# The code generator: a deploy (runtime, problem, paths, deploy) loads none of it
CODEGEN = ("codegen", "toolchain")
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(parts: tuple[str, ...]) -> str:
    """The layer unit of a module given as its path parts under the package: a wing's module
    (``runtime.device``, ``codegen.kernels`` for the whole kernels package), or a top-level one."""
    parts = tuple(p.removesuffix(".py") for p in parts)
    if parts[0] in WINGS:
        return ".".join(parts[:2]) if len(parts) > 1 and parts[1] != "__init__" else parts[0]
    return parts[0]


def _module_of(path: Path) -> str:
    return _unit(path.relative_to(PKG).parts)


def _imports(path: Path) -> set[str]:
    """The layer units that ``path`` imports (relative imports resolved)."""
    found = set()
    here = path.relative_to(PKG).parent.parts
    me = _module_of(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            mod = base + tuple(node.module.split(".")) if node.module else base
            mods = [mod + (a.name,) for a in node.names] if _unit(mod or ("",)) in WINGS + ("",) else [mod]
            found.update(_unit(m) for m in mods if m)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.update(_unit(tuple(n.split(".")[1:])) for n in names if n.startswith("fmha_iree."))
    return {d for d in found if d != me}


def test_every_module_has_a_layer():
    modules = {_module_of(p) for p in PKG.rglob("*.py")} - set(WINGS)  # a wing's __init__ holds only its docstring
    assert modules <= set(LAYER), f"modules without a layer: {sorted(modules - set(LAYER))}"
    faces = [p for w in WINGS for p in [PKG / w / "__init__.py"] if ast.parse(p.read_text()).body[1:]]
    assert not faces, f"a wing's __init__ that does more than say what the wing is: {faces}"


def test_imports_go_downward():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module_of(path)
        for dep in _imports(path):
            if me in WINGS or LAYER[dep] >= LAYER[me]:
                bad.append(f"{path.relative_to(PKG)} imports {dep} (layer {LAYER[dep]} >= {LAYER.get(me)})")
    assert not bad, "\n".join(bad)


def test_importing_the_runtime_loads_nothing_above_it():
    code = ("import sys, fmha_iree.runtime.module; "
            "print(' '.join(m for m in sys.modules if m.startswith('fmha_iree.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    loaded = {m.split(".", 1)[1] for m in out}
    assert all(m.startswith("runtime") for m in loaded), f"import fmha_iree.runtime.module loaded {sorted(loaded)}"
    assert "torch" not in out


def test_cache_fingerprint_hashes_every_wing_the_compile_imports():
    """Editing a file outside the hashed wings keeps cached modules: the compile imports nothing
    there but the runtime's device arrays (they generate no code)."""
    from fmha_iree.toolchain.compile import SHAPES_MODULES

    code = ("import sys, fmha_iree.toolchain.compile; "
            "print(' '.join(m for m in sys.modules if m.startswith('fmha_iree.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    wings = {m.split(".")[1] for m in out}
    assert wings - SHAPES_MODULES <= {"runtime"}, sorted(wings - SHAPES_MODULES)
    runtime = sorted(m for m in out if m.startswith("fmha_iree.runtime."))
    assert runtime == ["fmha_iree.runtime.allocation", "fmha_iree.runtime.device"], runtime


def test_a_deploy_loads_no_code_generator():
    """``fmha_iree.load`` and the paths it runs import nothing of code generation, torch or the
    compiler (tests/test_deploy.py runs a module so, with those imports blocked)."""
    code = ("import sys, fmha_iree.deploy, fmha_iree.paths; "
            "print(' '.join(m for m in sys.modules if m.startswith(('fmha_iree.', 'torch', 'iree.compiler'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    loaded = {m.split(".")[1] for m in out if m.startswith("fmha_iree.")}
    assert not loaded & set(CODEGEN), f"a deploy loaded the code generator's {sorted(loaded & set(CODEGEN))}"
    assert not [m for m in out if not m.startswith("fmha_iree.")], out


def test_no_dated_figures_in_code():
    """Code comments keep the why and the benchmark they cite, not dated measurements: no date in
    the package's source (the tuned configs' data file records when each was swept)."""
    import re

    dated = re.compile(r"20\d\d-\d\d-\d\d")
    found = [f"{p.relative_to(PKG)}:{i}" for p in sorted(PKG.rglob("*")) if p.suffix in (".py", ".in", ".mlir")
             for i, line in enumerate(p.read_text().splitlines(), 1) if dated.search(line)]
    assert not found, found
