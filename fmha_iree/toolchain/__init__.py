"""The toolchain: ``iree-compile`` run on a module's source with the target's flags, the PTX patch, ISA reports and
the compiled-module caches (keyed by every file of ``problem``, ``codegen`` and ``toolchain`` and the toolchain's
versions and flags).
"""
