#!/usr/bin/env python3
"""docs/BENCHMARKS.md's current tables, one per device, from the raw result files they cite.

    python scripts/bench_tables.py            # print the tables (Markdown)
    python scripts/bench_tables.py --write    # rewrite the block between the markers in BENCHMARKS.md
    python scripts/bench_tables.py --check    # exit 1 if BENCHMARKS.md's block differs from the files
    python scripts/bench_tables.py --files    # the raw files the tables cite, one a line

The rows are kept by hand in ``docs/bench/current.json``: for each device its hardware, the commands
that produced its files and, per case, the file(s) under ``docs/bench/`` holding the current figure
and how to read it there. A new run that supersedes a row: its files go to ``docs/bench/``, the row
points at them (date, command), ``--write`` regenerates the block. Row fields:

- ``format``: ``bench`` (``scripts/bench.py``'s ``.json`` or its printed ``.txt``), ``varlen``
  (``scripts/bench_varlen.py``'s ``.json`` or ``.txt``), ``json`` (a list of row objects, or an
  object whose ``rows_key`` holds one; ``ours`` names the field), ``regex`` (``pattern`` with named
  groups ``ours`` / ``peer``, optionally ``ours2`` / ``peer2``: every match in every file), ``literal``
  (``ours`` is the text shown: compiled-code results, no timing).
- ``files``: one file, or several rounds of one command (shown ``a / b``).
- ``select``: the fields that pick one row of a file (equal as strings); ``selects``: a series of
  such rows shown ``a / b / c`` (e.g. one case at several lengths).
- ``peer``: a peer's name in the row (``flash``, ``flex``, ``varlen``, ``default``, ...), or
  ``{"row": {select}, "name": ...}`` (another row of the same file, e.g. our contiguous call),
  ``{"field": ..., "name": ...}`` (``json``), ``{"literal": text}``; ``regex`` rows name theirs
  with ``peer_name``. Ratio = the peer's time / ours: below 1x fmha_iree is slower.
- ``combine``: ``rounds`` (default: every value, ``a / b``) or ``range`` (``min-max``).
- ``show``: extras after the figure, ``host`` (time to issue the call) and ``gbs`` (K / V GB/s).
- ``date``, ``command`` (a key of the device's ``commands``), ``see`` (a heading of BENCHMARKS.md).

Pure standard library; reads only ``current.json`` and the files it names.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
SPEC = BENCH / "current.json"
TARGET = DOCS / "BENCHMARKS.md"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"


class SpecError(Exception):
    pass


class Num(float):
    """A figure as the raw file printed it: compared as a float, shown with the file's digits."""

    def __new__(cls, text: str):
        obj = super().__new__(cls, text)
        obj.text = text
        return obj


# Peers as the tables name them (the benchmarks' own keys otherwise).
PEER_NAMES = {"varlen": "varlen_attn", "sdpa_loop": "SDPA loop", "sdpa_loop_gather": "SDPA loop with its page gather",
              "default": "torch SDPA", "torch": "torch SDPA"}


# ---- raw file readers: each returns a list of normalized rows -------------------------------------

_PEER = re.compile(r"([A-Za-z_+]+) ([\d.]+) ms \(([\d.]+)x\)")
_BENCH_LINE = re.compile(
    r"^(?P<label>\S.*?)\s+B=(?P<B>\d+)\s+H=(?P<Hq>\d+)/(?P<Hk>\d+)\s+(?P<Sq>\d+)x(?P<Sk>\d+)\s+"
    r"D=(?P<D>\d+)\s+(?P<dtype>\w+)\s+mask=(?P<mask>\S+)\s+fmha_iree\s+(?P<ms>[\d.]+) ms(?P<rest>.*)$")
_VARLEN_HEAD = re.compile(
    r"^(?P<label>\S.*?)\s+B=(?P<B>\d+)\s+H=(?P<Hq>\d+)/(?P<Hk>\d+)\s+.*?D=(?P<D>\d+) (?P<dtype>\w+) "
    r"mask=(?P<mask>\S+)(?: page=(?P<page>\d+))?\s+\[(?P<inputs>\w+)\]\s*$")
_VARLEN_BODY = re.compile(r"^\s+fmha_iree\s+(?P<ms>[\d.]+) ms(?P<rest>.*)$")


def _extras(rest: str, row: dict) -> dict:
    ours, _, peers = rest.partition("|")
    m = re.search(r"host(?: issue)? ([\d.]+) ms", ours)
    row["host"] = Num(m.group(1)) if m else None
    m = re.search(r"([\d.]+) GB/s", ours)
    row["gbs"] = Num(m.group(1)) if m else None
    row["peers"] = {name: Num(ms) for name, ms, _ in _PEER.findall(peers.split("|")[0])}
    return row


def _num(v):
    return int(v) if isinstance(v, str) and v.isdigit() else v


def read_bench_txt(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        m = _BENCH_LINE.match(line)
        if m:
            row = {k: _num(v) for k, v in m.groupdict().items() if k not in ("ms", "rest")}
            row["ms"] = Num(m.group("ms"))
            rows.append(_extras(m.group("rest"), row))
    return rows


def read_varlen_txt(text: str) -> list[dict]:
    rows, head = [], None
    for line in text.splitlines():
        m = _VARLEN_HEAD.match(line)
        if m:
            head = {k: _num(v) for k, v in m.groupdict().items()}
            continue
        m = _VARLEN_BODY.match(line)
        if m and head is not None:
            row = dict(head, ms=Num(m.group("ms")))
            rows.append(_extras(m.group("rest"), row))
            head = None
    return rows


def _from_json_row(r: dict) -> dict:
    row = dict(r)
    if row.get("Sq") is None and row.get("S") is not None:  # runs before 2026-12-01: S and causal
        row["Sq"] = row["Sk"] = row["S"]
    if row.get("mask") is None and "causal" in row:
        row["mask"] = "b" if row["causal"] else "0"
    row["ms"] = r.get("fmha_iree_ms")
    row["host"] = r.get("host_issue_ms")
    row["gbs"] = r.get("kv_gb_per_s")
    row["peers"] = {m.group(1): v for k, v in r.items()
                    if (m := re.fullmatch(r"torch_(.+)_ms", k)) and isinstance(v, (int, float))}
    return row


_CACHE: dict[tuple, object] = {}


def _text(name: str) -> str:
    path = BENCH / name
    if not path.is_file():
        raise SpecError(f"docs/bench/{name}: no such file")
    return path.read_text(errors="replace")


def rows_of(name: str, fmt: str, rows_key: str | None = None) -> list[dict]:
    key = (name, fmt, rows_key)
    if key not in _CACHE:
        text = _text(name)
        if name.endswith(".json"):
            data = json.loads(text)
            if rows_key:
                data = data[rows_key]
            rows = [_from_json_row(r) for r in data] if fmt in ("bench", "varlen") else data
        elif fmt == "bench":
            rows = read_bench_txt(text)
        elif fmt == "varlen":
            rows = read_varlen_txt(text)
        else:
            raise SpecError(f"{name}: format {fmt!r} reads .json only")
        if not rows:
            raise SpecError(f"docs/bench/{name}: no {fmt} rows found")
        _CACHE[key] = rows
    return _CACHE[key]


def pick(rows: list[dict], select: dict, name: str) -> dict:
    hits = [r for r in rows if all(str(r.get(k)) == str(v) for k, v in select.items())]
    if len(hits) != 1:
        labels = sorted({str(r.get("label")) for r in rows})
        raise SpecError(f"docs/bench/{name}: {len(hits)} rows match {select} (labels: {labels})")
    return hits[0]


# ---- one table row -------------------------------------------------------------------------------

def _decimals(text: str) -> int:
    return len(text.partition(".")[2])


def fmt_num(v: float) -> str:
    """3 significant-ish digits (1.938, 13.56, 185.5, 1331); a figure printed with fewer digits
    in its raw file keeps the file's."""
    out = _fmt(float(v))
    if isinstance(v, Num) and _decimals(v.text) < _decimals(out):
        return v.text
    return out


def _fmt(v: float) -> str:
    if v < 10:
        return f"{v:.3f}"
    if v < 100:
        return f"{v:.2f}"
    if v < 1000:
        return f"{v:.1f}"
    return f"{v:.0f}"


def joined(values: list[float], combine: str) -> str:
    if combine == "range" and len(values) > 1:
        lo, hi = min(values), max(values)
        return fmt_num(lo) if fmt_num(lo) == fmt_num(hi) else f"{fmt_num(lo)}-{fmt_num(hi)}"
    return " / ".join(fmt_num(v) for v in values)


def ratios(ours: list[float], peers: list[float], combine: str) -> str:
    rs = [p / o for o, p in zip(ours, peers)]
    if combine == "range" and len(rs) > 1:
        lo, hi = f"{min(rs):.2f}", f"{max(rs):.2f}"
        return f"{lo}x" if lo == hi else f"{lo}-{hi}x"
    return " / ".join(f"{r:.2f}" for r in rs) + "x"


def measure(spec: dict) -> dict:
    """The row's cells: ours, peer, ratio (strings) from its files."""
    fmt = spec.get("format", "bench")
    files = spec.get("files") or []
    combine = spec.get("combine", "rounds")
    unit = spec.get("unit", "ms")
    if fmt == "literal":
        return {"ours": spec["ours"], "peer": spec.get("peer", ""), "ratio": spec.get("ratio", "")}
    if not files:
        raise SpecError(f"{spec['case']!r}: no files")
    ours, peer_vals, extras = [], [], {"host": [], "gbs": []}
    peer = spec.get("peer")
    peer_name = spec.get("peer_name")
    if fmt == "regex":
        pat = re.compile(spec["pattern"])
        for name in files:
            found = list(pat.finditer(_text(name)))
            if not found:
                raise SpecError(f"docs/bench/{name}: pattern of {spec['case']!r} matches nothing")
            for m in found:
                g = m.groupdict()
                for o, p in (("ours", "peer"), ("ours2", "peer2")):
                    if g.get(o) is not None:
                        ours.append(Num(g[o]))
                        if g.get(p) is not None:
                            peer_vals.append(Num(g[p]))
    else:
        selects = spec.get("selects") or [spec.get("select", {})]
        for name in files:
            rows = rows_of(name, fmt, spec.get("rows_key"))
            for sel in selects:
                row = pick(rows, sel, name)
                ours.append(row[spec["ours"]] if fmt == "json" else row["ms"])
                for k in extras:
                    if row.get(k) is not None:
                        extras[k].append(row[k])
                if isinstance(peer, str):
                    if peer not in row.get("peers", {}):
                        raise SpecError(f"docs/bench/{name}: no peer {peer!r} in {sel} "
                                        f"(peers: {sorted(row.get('peers', {}))})")
                    peer_vals.append(row["peers"][peer])
                    peer_name = peer
                elif isinstance(peer, dict) and "row" in peer:
                    peer_vals.append(pick(rows, peer["row"], name)["ms"])
                    peer_name = peer["name"]
                elif isinstance(peer, dict) and "field" in peer:
                    peer_vals.append(row[peer["field"]])
                    peer_name = peer["name"]
    text = f"{joined(ours, combine)} {unit}"
    for k in spec.get("show", []):
        if extras[k] and k == "host":
            text += f" (host {joined(extras[k], combine)} ms)"
        elif extras[k]:
            text += " (" + " / ".join(f"{v:.0f}" for v in extras[k]) + " GB/s)"
    cells = {"ours": text, "peer": "", "ratio": ""}
    if isinstance(peer, dict) and "literal" in peer:
        cells["peer"] = peer["literal"]
    elif peer_vals:
        if len(peer_vals) != len(ours):
            raise SpecError(f"{spec['case']!r}: {len(ours)} figures against {len(peer_vals)} peer figures")
        cells["peer"] = f"{PEER_NAMES.get(peer_name, peer_name)} {joined(peer_vals, combine)} {unit}"
        cells["ratio"] = ratios(ours, peer_vals, combine)
    return cells


# ---- the Markdown --------------------------------------------------------------------------------

def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _raw(spec: dict) -> str:
    files = spec.get("files") or []
    links = ", ".join(f"[{f}](bench/{f})" for f in files)
    if spec.get("see"):
        see = f'"{spec["see"]}"'
        return f"{links}; {see}" if links else f"none; {see}"
    return links or "none"


def device_table(dev: dict) -> list[str]:
    out = [f"### {dev['title']}", "", dev["hardware"], ""]
    compiled = dev.get("columns") == "compiled"
    if compiled:
        out += ["| case | result | date | command | raw file; details |", "|---|---|---|---|---|"]
    else:
        out += ["| case | fmha_iree | peer | ratio | date | command | raw file |", "|---|---|---|---|---|---|---|"]
    commands = dev.get("commands", {})
    for spec in dev["rows"]:
        if spec.get("command") not in commands:
            raise SpecError(f"{dev['id']}: {spec['case']!r}: command {spec.get('command')!r} not in its commands")
        c = measure(spec)
        cmd = f"`{spec['command']}`"
        if compiled:
            cells = [spec["case"], c["ours"], spec.get("date", ""), cmd, _raw(spec)]
        else:
            cells = [spec["case"], c["ours"], c["peer"], c["ratio"], spec.get("date", ""), cmd, _raw(spec)]
        out.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    used = [k for k in commands if any(r.get("command") == k for r in dev["rows"])]
    dirs = any("DIR" in line for k in used for line in commands[k])
    out += ["", "Commands, by the table's `command` (`DIR`: a folder of modules built by the `fmha-iree compile` lines):"
            if dirs else "Commands, by the table's `command`:", "", "```sh"]
    for k in used:
        out += [f"# --- {k}"] + commands[k]
    return out + ["```", ""]


def render() -> str:
    spec = json.loads(SPEC.read_text())
    lines = ["<!-- Generated by scripts/bench_tables.py from docs/bench/current.json: edit those, not this block. -->", ""]
    for dev in spec["devices"]:
        lines += device_table(dev)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def cited_files() -> list[str]:
    spec = json.loads(SPEC.read_text())
    return sorted({f for dev in spec["devices"] for r in dev["rows"] for f in r.get("files") or []})


def check_see(doc: str) -> None:
    """Every row's ``see`` names a heading or a bold paragraph title of BENCHMARKS.md."""
    titles = [m.group(1) or m.group(2) for m in re.finditer(r"(?m)^#+ (.+)$|^\*\*(.+?)\*\*", doc)]
    spec = json.loads(SPEC.read_text())
    for dev in spec["devices"]:
        for r in dev["rows"]:
            see = r.get("see")
            if see and not any(t == see or t.startswith(see + " (") for t in titles):
                raise SpecError(f"{dev['id']}: {r['case']!r}: see {see!r} is no heading of {TARGET.name}")


def splice(doc: str, block: str) -> str:
    i, j = doc.find(BEGIN), doc.find(END)
    if i < 0 or j < i:
        raise SpecError(f"{TARGET.relative_to(ROOT)}: markers {BEGIN} / {END} not found")
    return doc[:i + len(BEGIN)] + "\n" + block + doc[j:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the tables block of docs/BENCHMARKS.md")
    g.add_argument("--check", action="store_true", help="exit 1 if docs/BENCHMARKS.md's block is stale")
    g.add_argument("--files", action="store_true", help="list the raw files the tables cite")
    args = ap.parse_args(argv)
    try:
        if args.files:
            print("\n".join(cited_files()))
            return 0
        block = render()
        if not (args.write or args.check):
            sys.stdout.write(block)
            return 0
        doc = TARGET.read_text()
        check_see(doc)
        new = splice(doc, block)
        if args.write:
            if new != doc:
                TARGET.write_text(new)
            return 0
        if new != doc:
            diff = difflib.unified_diff(doc.splitlines(), new.splitlines(), "BENCHMARKS.md", "generated", lineterm="", n=1)
            sys.stderr.write("\n".join(list(diff)[:60]) + "\n")
            sys.stderr.write("docs/BENCHMARKS.md's tables are stale: run python scripts/bench_tables.py --write\n")
            return 1
        return 0
    except SpecError as e:
        sys.stderr.write(f"bench_tables: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
