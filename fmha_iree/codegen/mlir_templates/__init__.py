"""MLIR templates for the GPU entry points and the CPU's ``rows_packed``, one file per kernel
variant, rendered from ``fmha_iree/codegen/mlir/*.mlir.in`` or generated (see ``lowering.py`` for the
lowering configs they carry):

- ``step.py``: the plan's ``step`` (one fused ``online_attention`` per wave)
- ``dense.py``: ``dense``, ``dense_o_s<S>`` / ``causal_o_s<S>``
- ``copies.py``: the copies and views the dense templates share
- ``rows_packed.py``: the CPU's short queries of packed sequences, K / V read in place
- ``unit_loop.py``: the CPU's ``units``, any batch-mode problem as the plan's units looped in the module
"""

from .dense import TRANSPOSE_V_MIN_SEQLEN, render_dense, render_dense_out
from .lowering import default_lowering, rdna_fwd_lowering, render_lowering_attrs
from .rows_packed import render_rows_packed
from .step import render_online_step

__all__ = ["render_online_step", "render_dense", "render_dense_out", 
           "default_lowering", "rdna_fwd_lowering", "render_lowering_attrs",
           "TRANSPOSE_V_MIN_SEQLEN", "render_rows_packed"]
