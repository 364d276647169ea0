"""Code generation: a module's entry points rendered as MLIR (the ``fwd`` family's kernels, the templates, the CPU's
whole-row graphs) and the manifest's table of entry points and capabilities.
"""
