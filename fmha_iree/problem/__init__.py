"""The problem: what a caller asks for (masks, tile configs under CK's names, targets, the checked problem spec,
a paged cache, the tiling plan) and the ABI constants that code generation, the paths and the runtime share.
"""
