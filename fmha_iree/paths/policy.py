"""Every performance threshold the paths choose by, in one place. Each says why it is where it is
and cites the measurement that set it (``docs/thresholds.md``, by heading). Limits that are not a
choice (a grid's size, a piece's slots) stay with the path that has them.
"""

from __future__ import annotations

__all__ = ["ROWS_MAX_ROWS", "ROWS_MAX_SCORES", "PACKED_MAX_QUERIES", "PACKED_MAX_QUERIES_MHA", "PACKED_MAX_ROWS",
           "PAD_LIMIT", "GROUP_KEYS", "BATCH_WAVE_MIN_ROWS", "BATCH_WAVE_MAX_KEYS", "WAVE_MAX_ROWS",
           "SQUARE_CAUSAL_MIN", "PIECE_KEYS", "GATHER_PAGE"]

# CPU ``rows`` (``paths.rows``) holds every score of a call, so it takes short queries: at most
# ROWS_MAX_ROWS query rows per KV head (G * Sq), at most ROWS_MAX_SCORES scores (128 MiB of f32,
# and as much for their exponentials). Above 128 rows the tile plan's skipped blocks win.
# docs/thresholds.md, "CPU rows: how many query rows".
ROWS_MAX_ROWS = 128
ROWS_MAX_SCORES = 1 << 25

# Group mode's short sequences take ``rows_packed`` (``paths.cpu_group``) up to this many query
# rows per sequence (each query row against its own keys; without GQA it loses sooner).
# docs/thresholds.md, "CPU rows_packed against rows_kpad".
PACKED_MAX_QUERIES = 16
PACKED_MAX_QUERIES_MHA = 8  # G = 1
PACKED_MAX_ROWS = 64  # query rows per KV head: the most measured

# A group of short sequences is computed up to its longest keys; a group closes once padding it
# to the next sequence's keys would compute PAD_LIMIT times its own keys and it holds GROUP_KEYS
# keys. docs/thresholds.md, "CPU decode groups".
PAD_LIMIT = 1.25
GROUP_KEYS = 8192

# A host batch-mode problem of at least BATCH_WAVE_MIN_ROWS query rows against at most
# BATCH_WAVE_MAX_KEYS keys runs as group mode (``paths.cpu_group``) rather than through ``rows`` or
# ``units``. docs/thresholds.md, "CPU batches as group mode".
BATCH_WAVE_MIN_ROWS = 64
BATCH_WAVE_MAX_KEYS = 1024

# Group mode's sequences of at most this many query rows take ``waves_varlen``, longer ones
# ``units_varlen``. docs/thresholds.md, "CPU waves against units".
WAVE_MAX_ROWS = 512

# Batches without cu_seqlen padding that ``fwd_tiles`` takes over ``fwd``: square causal ones of at
# least this many rows (windows keep ``fwd``'s banded path, measured faster for them).
# docs/thresholds.md, "GPU tiles against fwd in batch mode".
SQUARE_CAUSAL_MIN = 2048

# ``fwd_packed``'s piece widths, widest first (multiples of the modules' key tile), and the rows
# per page when runs with gaps are gathered for the pieces. docs/thresholds.md, "GPU decode pieces".
PIECE_KEYS = (256, 128, 64)
GATHER_PAGE = 64
