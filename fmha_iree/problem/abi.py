"""The constants a module's entry points and the host that calls them must agree on: table columns,
scalar names and fixed sizes. Code generation (``kernels``, ``mlir_templates``, ``graph``, ``rows``)
and the host paths (``paths``) both read them here, so a deploy imports no code generator to call
a module. Changing one changes the ABI: bump ``ABI_VERSION`` with it.
"""

from __future__ import annotations

__all__ = ["ABI_VERSION", "MANIFEST_FORMAT", "PLAN_DESC_COLUMNS", "ROWS_DESC_COLUMNS", "ROWS_PACKED_DESC_COLUMNS",
           "UNIT_TILE_COLUMNS", "TILE_COLUMNS", "TILE_STEP", "EDGE_PARTS", "PREFIX_STEPS", "RAGGED_SCALARS",
           "PREFIX_SCALARS", "PACKED_SCALARS", "PAGE_ROWS", "PAGE_GROUP", "PIECE_ROWS", "CPU_WAVE_ROWS",
           "CPU_WAVE_KEYS", "BIAS_ROWS", "BIAS_ROWS_SHORT"]

# The torch graphs' ABI (``graph.py``) and the manifest's format: a manifest of another format was
# written by an fmha_iree whose modules this one does not call (``deploy.load`` refuses it).
ABI_VERSION = 3
MANIFEST_FORMAT = "fmha_iree.module/3"

# The tile plan's ``step`` descriptor, one row per unit (``plan.Plan``)
PLAN_DESC_COLUMNS = ("tile", "b", "q0", "k0", "qrel0", "krel0", "qlen", "klen", "y", "x")
# The CPU's ``rows`` / ``rows_kpad`` descriptor, one row per batch entry
ROWS_DESC_COLUMNS = ("qlen", "klen", "y", "x")
# The CPU's ``rows_packed`` / ``rows_packed_pages`` descriptor, one row per sequence
ROWS_PACKED_DESC_COLUMNS = ("q_start", "qlen", "k_start", "klen", "y", "x")
# The CPU's ``units_varlen`` table, one row per tile of query rows (``plan.unit_tiles``)
UNIT_TILE_COLUMNS = ("row", "s0", "q_len", "k_start", "k_len", "y", "x", "g")
# ``waves_varlen``: slots of this many query rows advance a chunk of this many keys per step
CPU_WAVE_ROWS = 64
CPU_WAVE_KEYS = 64

# ``fwd_tiles`` / ``fwd_tiles_paged``: one table row per tile (``paths.tiles.tile_table``); the
# interior's key count is a multiple of ``TILE_STEP``; the edge runs ``EDGE_PARTS`` workgroups a tile.
# ``a0``: the tile's first row in the mask's frame (ALiBi's zero point), ``sr``: its row of the slopes
# (with an elementwise bias: its sequence's first bias plane)
TILE_COLUMNS = ("q0", "k0", "nk", "ne", "pos0", "kl", "x", "entry", "y", "lo", "nl", "nh", "a0", "sr")
TILE_STEP = 64
EDGE_PARTS = 2
# An elementwise bias's planes hold at least a tile's rows (``problem.bias``): the most rows of a
# tile on any target, and of a short tile (decode-shaped calls, at most this many rows a sequence)
BIAS_ROWS = 128
BIAS_ROWS_SHORT = 16

# ``fwd_ragged``'s scalars after the scale, then its prefix table's (``paths.ragged``)
PREFIX_STEPS = 16
RAGGED_SCALARS = ("B", "Sq", "Sk", "NP", "P", "No", "Ro", "Nl", "Rl", "y", "x", "yu", "xu", "khi", "khiu")
PREFIX_SCALARS = ("U", *(f"nb{i}" for i in range(PREFIX_STEPS)))

# ``fwd_packed*``: the pieces' scalars (``paths.packed``); query rows a piece holds; in the
# ``pages`` mode, pieces are ``PAGE_GROUP`` sub-pages of ``PAGE_ROWS`` rows
PACKED_SCALARS = ("W", "NPc", "P0", "S")
PIECE_ROWS = 16
PAGE_ROWS = 64
PAGE_GROUP = 4
