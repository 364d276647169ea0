"""What the pinned iree-turbine (3.9.0) needs to export a model against the pinned compiler's MLIR
Python bindings (iree-base-compiler 3.13.0), in one place. Each shim names the upstream change it
stands in for; ``tests/test_model_export.py`` fails once the pinned versions no longer need it.

- ``Type.isinstance``: the 3.13 bindings dropped the static ``isinstance`` of the type (and value) classes
  (llvm-project #172892); turbine 3.9.0 still calls it when it converts a custom op's operand types
  (``iree/turbine/dynamo/type_conversion.py``), so ``aot.export`` of a model with an expanded
  custom op raised ``AttributeError: type object 'IntegerType' has no attribute 'isinstance'``.
  Turbine's main fixed it (iree-org/iree-turbine#1260, commit dc5ce4aa), in no release yet. The
  shim gives each class turbine calls it on (types, and ``OpResult`` / ``BlockArgument`` when it
  erases the expanded op) a static ``isinstance`` that tries the class's casting constructor.
"""

from __future__ import annotations

__all__ = ["TYPE_CLASSES", "needs_isinstance_shim", "apply"]

# The type and value classes turbine 3.9.0 calls ``<class>.isinstance(...)`` on
TYPE_CLASSES = ("F16Type", "F32Type", "F64Type", "IndexType", "IntegerType", "MemRefType", "RankedTensorType",
                "ShapedType", "VectorType", "OpResult", "BlockArgument")


def needs_isinstance_shim() -> list[str]:
    """The type classes of the installed bindings without a static ``isinstance`` (shimmed or
    not: a shimmed class is marked)."""
    from iree.compiler import ir

    return [name for name in TYPE_CLASSES
            if not hasattr(getattr(ir, name), "isinstance") or getattr(getattr(ir, name), "_fmha_iree_shim", False)]


def _isinstance_of(cls):
    def check(value) -> bool:
        try:
            cls(value)  # the bindings' casting constructor: raises where value is not a cls
        except (ValueError, TypeError):
            return False
        return True

    return staticmethod(check)


def apply() -> None:
    """Install the shims where the bindings lack what turbine calls (idempotent)."""
    from iree.compiler import ir

    for name in TYPE_CLASSES:
        cls = getattr(ir, name)
        if not hasattr(cls, "isinstance"):
            cls.isinstance = _isinstance_of(cls)
            cls._fmha_iree_shim = True
