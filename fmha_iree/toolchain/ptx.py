"""Native exp2 in IREE's CUDA kernels (the compile stage's PTX pass).

IREE 3.13 lowers ``math.exp2`` differently per target (``Codegen/Common/MathTransform.cpp``):
on ROCm it stays an intrinsic (one ``v_exp_f32``), on CUDA it is expanded into ``exp(x * ln 2)``
and then into a range-reduced polynomial of 25 instructions (clamps, floor, seven FMAs, exponent
bits). The attention kernels take one exp2 per score, so on the CUDA proxy the softmax's ALU work
outweighs the tensor-core work and the proxy underrates the kernel that the gfx targets get (on
the H200 native exp2 made the d128 kernel faster, and more so with tiles that only pay once it is
native: docs/BENCHMARKS.md, "How the constants were chosen").

``native_exp2`` finds each expanded polynomial in IREE's PTX by its dataflow (every instruction,
register and constant of the expansion, operands of commutative ops in either order) and replaces
it with ``ex2.approx.ftz.f32``, the instruction that the ROCm lowering's counterpart (and CUDA's
``exp2f`` under fast math) uses: relative error 2^-22, subnormal results flushed to zero (the
softmax's exp2 arguments are <= 0; an underflow to 0 instead of a subnormal is below f16/bf16
resolution). An expansion whose intermediate values are used elsewhere, or any other code, is
left as it is. The patched PTX goes back into the module through IREE's
``--iree-hal-substitute-executable-objects-from`` (see ``compile.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["native_exp2", "find_exp2", "patch_dir", "Exp2Report", "Exp2Site"]

_INSTR = re.compile(r"^\s*(?P<op>[a-z][\w.]*)\s+(?P<args>[^;]*);\s*$")
_COMMUTATIVE = {"mul.rn.f32": 2, "add.rn.f32": 2, "fma.rn.f32": 2, "add.s32": 2}

# The expansion IREE 3.13 emits for exp2(X), as a dataflow tree rooted at OUT:
# name -> (opcode, operands...); an operand is a name (bound to one register), or a literal.
_EXP2_TREE = {
    "OUT": ("mul.rn.f32", "S", "V"),
    "S": ("add.rn.f32", "R", "0f3F800000"),
    "R": ("fma.rn.f32", "P5", "Q", "J"),
    "Q": ("mul.rn.f32", "J", "J"),
    "P5": ("fma.rn.f32", "P4", "J", "0f3F000000"),
    "P4": ("fma.rn.f32", "P3", "J", "0f3E2AAAAA"),
    "P3": ("fma.rn.f32", "P2", "J", "0f3D2AA9C1"),
    "P2": ("fma.rn.f32", "P1", "J", "0f3C088908"),
    "P1": ("fma.rn.f32", "J", "0f39506967", "0f3AB743CE"),
    "J": ("fma.rn.f32", "H", "0f395E8083", "I"),
    "I": ("fma.rn.f32", "H", "0fBF318000", "C"),
    "V": ("add.s32", "U", "1065353216"),
    "U": ("shl.b32", "T", "23"),
    "T": ("cvt.rzi.s32.f32", "H"),
    "H": ("selp.f32", "0f42FE0000", "G", "PG"),
    "PG": ("setp.gt.f32", "G", "0f42FE0000"),
    "G": ("selp.f32", "0fC2FE0000", "E", "PE"),
    "PE": ("setp.lt.f32", "E", "0fC2FE0000"),
    "E": ("cvt.rmi.f32.f32", "D"),
    "D": ("fma.rn.f32", "C", "0f3FB8AA3B", "0f3F000000"),
    "C": ("selp.f32", "0f42B1999A", "B", "PC"),
    "PC": ("setp.gt.f32", "B", "0f42B1999A"),
    "B": ("selp.f32", "0fC2AF999A", "A", "PB"),
    "PB": ("setp.lt.f32", "A", "0fC2AF999A"),
    "A": ("mul.rn.f32", "X", "0f3F317218"),
}
_LEAF = "X"


@dataclass(frozen=True)
class Exp2Report:
    """What ``native_exp2`` did: expansions replaced, and floor instructions (``cvt.rmi``, one per
    expansion) left in the text, which counts expansions it did not recognize."""

    replaced: int
    floors_left: int


@dataclass
class _Instr:
    line: int
    op: str
    dst: str
    srcs: tuple


def _parse(lines: list[str], start: int, end: int) -> list[_Instr]:
    out = []
    for i in range(start, end):
        m = _INSTR.match(lines[i])
        if not m or lines[i].lstrip().startswith("@"):
            continue
        args = tuple(a.strip() for a in m.group("args").split(","))
        if len(args) >= 2 and args[0].startswith("%"):
            out.append(_Instr(i, m.group("op"), args[0], args[1:]))
    return out


_REG = re.compile(r"%[A-Za-z_][\w]*")


def _uses(lines: list[str], start: int, end: int, instrs: list[_Instr]) -> dict[str, set]:
    """Lines that read each register: every register named on any line of the body (stores,
    predicated and vector operands included), less the destination of the defining instructions."""
    dst = {ins.line: ins.dst for ins in instrs}
    uses: dict[str, set] = {}
    for i in range(start, end):
        regs = _REG.findall(lines[i].split("//", 1)[0])
        if i in dst and regs and regs[0] == dst[i]:
            regs = regs[1:]
        for r in regs:
            uses.setdefault(r, set()).add(i)
    return uses


def _orders(ins: _Instr):
    n = _COMMUTATIVE.get(ins.op, 0)
    yield ins.srcs
    if n == 2 and len(ins.srcs) >= 2 and ins.srcs[0] != ins.srcs[1]:
        yield (ins.srcs[1], ins.srcs[0]) + ins.srcs[2:]


def _match(name: str, reg: str, defs: dict, bind: dict, used: list) -> bool:
    """Bind `name` to `reg` and match its defining instruction against the tree (backtracking
    over commutative operand orders)."""
    if name in bind:
        return bind[name] == reg
    if name == _LEAF:
        bind[name] = reg
        return True
    ins = defs.get(reg)
    pat = _EXP2_TREE[name]
    if ins is None or ins.op != pat[0] or len(ins.srcs) != len(pat) - 1:
        return False
    for srcs in _orders(ins):
        trial, trial_used = dict(bind), list(used)
        trial[name] = reg
        trial_used.append(ins)
        ok = True
        for want, got in zip(pat[1:], srcs):
            if want in _EXP2_TREE or want == _LEAF:
                if not got.startswith("%") or not _match(want, got, defs, trial, trial_used):
                    ok = False
                    break
            elif want != got:
                ok = False
                break
        if ok:
            bind.clear(), bind.update(trial)
            used[:] = trial_used
            return True
    return False


def _functions(lines: list[str]):
    """(start, end) line ranges of each .entry/.func body."""
    i, n = 0, len(lines)
    while i < n:
        if re.match(r"^\s*(\.visible\s+|\.weak\s+)?\.(entry|func)\b", lines[i]):
            j = i
            while j < n and "{" not in lines[j]:
                j += 1
            depth, k = 0, j
            while k < n:
                depth += lines[k].count("{") - lines[k].count("}")
                if depth == 0:
                    break
                k += 1
            yield j, k + 1
            i = k + 1
        else:
            i += 1


@dataclass(frozen=True)
class Exp2Site:
    """One recognized expansion: ``out = exp2(x)`` computed by the PTX lines ``lines`` (indices
    into ``ptx.split("\\n")``, in program order); ``at`` is the line that reads ``x`` (the
    replacement goes there, so a later redefinition of ``x`` cannot reach it)."""

    x: str
    out: str
    lines: tuple
    at: int


def find_exp2(ptx: str) -> list[Exp2Site]:
    """Every exp2 expansion in ``ptx`` whose intermediate values are read only inside it."""
    lines = ptx.split("\n")
    taken: set[int] = set()
    sites = []
    for start, end in _functions(lines):
        instrs = _parse(lines, start, end)
        ndef: dict[str, int] = {}
        for ins in instrs:
            ndef[ins.dst] = ndef.get(ins.dst, 0) + 1
        defs = {ins.dst: ins for ins in instrs if ndef[ins.dst] == 1}
        uses = _uses(lines, start, end, instrs)
        for ins in instrs:
            if ins.op != "mul.rn.f32" or ins.line in taken:
                continue
            bind: dict = {}
            used: list = []
            if not _match("OUT", ins.dst, defs, bind, used):
                continue
            block = {u.line for u in used}
            if block & taken:
                continue
            if any(not uses.get(u.dst, set()) <= block for u in used if u is not ins):
                continue  # an intermediate value is read outside the expansion
            taken |= block
            sites.append(Exp2Site(bind[_LEAF], ins.dst, tuple(sorted(block)), defs[bind["A"]].line))
    return sites


def native_exp2(ptx: str) -> tuple[str, Exp2Report]:
    """``ptx`` with every recognized exp2 expansion replaced by ``ex2.approx.ftz.f32``."""
    lines = ptx.split("\n")
    drop: set[int] = set()
    replace: dict[int, str] = {}
    for site in find_exp2(ptx):
        indent = re.match(r"^\s*", lines[site.at]).group(0)
        replace[site.at] = f"{indent}ex2.approx.ftz.f32 \t{site.out}, {site.x};"
        drop |= set(site.lines) - {site.at}
    text = "\n".join(replace.get(i, ln) for i, ln in enumerate(lines) if i not in drop)
    return text, Exp2Report(replaced=len(replace), floors_left=text.count("cvt.rmi.f32.f32"))


_DUMP_SUFFIX = re.compile(r"_cuda_nvptx_fb$")


def patch_dir(src, dst) -> dict:
    """Patch every ``<module>_<executable>_cuda_nvptx_fb.ptx`` that IREE dumped into ``src``
    (``--iree-hal-dump-executable-binaries-to`` with linking off) and write those that changed as
    ``dst/<module>_<executable>.ptx``, the name ``--iree-hal-substitute-executable-objects-from``
    looks for. Returns the totals."""
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    total = {"executables": 0, "executables_patched": 0, "replaced": 0, "floors_left": 0}
    for f in sorted(src.glob("*.ptx")):
        text, rep = native_exp2(f.read_text())
        total["executables"] += 1
        total["replaced"] += rep.replaced
        total["floors_left"] += rep.floors_left
        if rep.replaced:
            total["executables_patched"] += 1
            (dst / (_DUMP_SUFFIX.sub("", f.stem) + ".ptx")).write_text(text)
    return total


def main(argv=None) -> int:
    """``python -m fmha_iree.toolchain.ptx SRC DST``: ``patch_dir`` from the command line."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m fmha_iree.toolchain.ptx", description=patch_dir.__doc__)
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args(argv)
    print(json.dumps(patch_dir(a.src, a.dst)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
