"""The runtime: IREE devices and arrays, a loaded module's functions called with typed arguments, uploads and
replayed calls. It imports nothing else of fmha_iree, so a deploy needs only ``iree-base-runtime`` and numpy.
"""
