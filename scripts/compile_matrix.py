#!/usr/bin/env python3
"""Compile the default FMHA config of every target x head dim x dtype into one folder, with a
progress bar; prints a table (spills, VGPRs, LDS, occupancy) and writes matrix.json.

    python scripts/compile_matrix.py -o out/matrix [--targets gfx942,sm_80] [--hdims 64,128] [--dtypes f16]

Masks are runtime values of every module, so each entry serves all mask kinds.
"""
import sys

from fmha_iree.cli import main

if __name__ == "__main__":
    sys.exit(main(["matrix", *sys.argv[1:]]))
