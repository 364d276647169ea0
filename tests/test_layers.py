"""The package's layers: every module imports only modules of lower layers (or, inside the
``kernels`` and ``mlir_templates`` packages, its siblings), at the top of the file or inside a
function; so there is no import circle, and importing a low layer loads nothing above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fmha_iree

PKG = Path(fmha_iree.__file__).resolve().parent

# Lowest first. A module may import any module of an earlier layer.
LAYERS = [
    ["abi", "targets", "mask", "cache", "isa", "ptx", "torch_abi", "allocation"],  # leaves: no fmha_iree imports
    ["tiles"],  # tile configs under CK's names
    ["device"],  # IREE devices, DeviceTensor
    ["spec", "plan"],  # problem spec, tiling plan
    ["paged"],  # a paged KV cache's validation and gather
    ["rows"],  # codegen: the CPU's whole-key-row graphs (used by the torch graph module)
    ["graph", "mlir_templates"],  # codegen: the torch graph, MLIR templates and lowering configs
    ["kernels", "source_cpu"],  # codegen: the fwd family; a CPU module's functions
    ["source"],  # codegen: what a module holds, as MLIR
    ["entries"],  # codegen: the manifest's entry points and capabilities
    ["compile"],  # iree-compile, caches
    ["staging"],  # per-call uploads without a host wait
    ["runtime"],  # a loaded module's functions called (knows no paths)
    ["paths"],  # path selection and each path's host side
    ["torch_gpu", "prepared"],  # torch GPU tensors in and out; replays
    ["api", "deploy"],  # public entry points
    ["cli", "demo", "torch_ops", "distributed_args"],  # ...; context parallelism's arguments checked on every rank
    ["hf", "distributed", "__init__"],  # transformers integration, context parallelism (torch.distributed)
]
# The code generator: a deploy (runtime, paths, deploy) loads none of it
CODEGEN = {"rows", "graph", "mlir_templates", "kernels", "source_cpu", "source", "entries", "compile"}
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> set[str]:
    """Top-level fmha_iree modules that ``path`` imports (relative imports resolved)."""
    found = set()
    inside_package = path.parent != PKG
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level == 1 and inside_package:
                continue  # a sibling in the same package
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.update(n.split(".")[1] for n in names if n.startswith("fmha_iree."))
    return found


def test_every_module_has_a_layer():
    modules = {_module_of(p) for p in PKG.rglob("*.py")}
    assert modules <= set(LAYER), f"modules without a layer: {sorted(modules - set(LAYER))}"


def test_imports_go_downward():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module_of(path)
        for dep in _imports(path):
            if dep != me and LAYER[dep] >= LAYER[me]:
                bad.append(f"{path.relative_to(PKG)} imports {dep} (layer {LAYER[dep]} >= {LAYER[me]})")
    assert not bad, "\n".join(bad)


def test_importing_the_runtime_loads_nothing_above_it():
    code = "import sys, fmha_iree.runtime; print(' '.join(m for m in sys.modules if m.startswith('fmha_iree.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    loaded = {m.split(".")[1] for m in out}
    above = sorted(m for m in loaded if LAYER[m] > LAYER["runtime"])
    assert not above, f"import fmha_iree.runtime loaded {above}"
    assert "compile" not in loaded and "torch" not in out


def test_cache_fingerprint_leaves_out_only_layers_above_compile():
    """Editing a module above ``compile`` keeps cached modules; every other module is hashed."""
    from fmha_iree.compile import ABOVE_COMPILE

    assert all(LAYER[name] > LAYER["compile"] for name in ABOVE_COMPILE)
    assert {n for n in LAYER if LAYER[n] > LAYER["compile"]} == set(ABOVE_COMPILE)


def test_a_deploy_loads_no_code_generator():
    """``fmha_iree.load`` and the paths it runs import nothing of code generation, torch or the
    compiler (tests/test_deploy.py runs a module so, with those imports blocked)."""
    code = ("import sys, fmha_iree.deploy, fmha_iree.paths; "
            "print(' '.join(m for m in sys.modules if m.startswith(('fmha_iree.', 'torch', 'iree.compiler'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    loaded = {m.split(".")[1] for m in out if m.startswith("fmha_iree.")}
    assert not loaded & CODEGEN, f"a deploy loaded the code generator's {sorted(loaded & CODEGEN)}"
    assert not [m for m in out if not m.startswith("fmha_iree.")], out


def test_no_dated_figures_in_code():
    """Code comments keep the why and the benchmark they cite, not dated measurements: no date in
    the package's source (the tuned configs' data file records when each was swept)."""
    import re

    dated = re.compile(r"20\d\d-\d\d-\d\d")
    found = [f"{p.relative_to(PKG)}:{i}" for p in sorted(PKG.rglob("*")) if p.suffix in (".py", ".in", ".mlir")
             for i, line in enumerate(p.read_text().splitlines(), 1) if dated.search(line)]
    assert not found, found
