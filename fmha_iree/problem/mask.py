"""Attention masks with Composable Kernel's semantics (``block_masking.hpp``, example ``mask.hpp``).

A mask is a window of ``left`` keys before and ``right`` keys after each query row, aligned either
top-left (row ``i`` is centred on key ``i``) or bottom-right (centred on key ``i + Sk - Sq``,
FlashAttention's alignment). ``-1`` means that side is unlimited. Exactly, for a problem of ``Sq``
rows and ``Sk`` keys, CK builds (y, x)::

    if left < 0:  left  = Sq - 1 if top_left else Sk - 1
    if right < 0: right = Sk - 1 if top_left else Sq - 1
    x = 1 + right + (0 if top_left else Sk - Sq)
    y = 1 + left  + (0 if top_left else Sq - Sk)

and row ``i`` may see key ``j`` iff ``i - y + 1 <= j < min(i + x, Sk)`` and ``j >= 0``.
A row that may see no key yields O = 0 and LSE = -inf.

``sink`` (StreamingLLM's sink tokens, CK's mask option): the first ``sink`` keys also stay
visible to every row whose window does not reach them, as far as its right side allows: row ``i``
also sees key ``j < min(sink, min(i + x, Sk))``. The kernels see only the window
(``Mask.window_only``); ``paths.sink_tokens`` adds the sink keys to their results.

This module needs only numpy, so deployed modules can use it without torch.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

__all__ = ["Mask", "as_mask"]

_NO_LIMIT = 2**31 - 1  # window sides from here on see every key (lengths stay below it)


@dataclasses.dataclass(frozen=True)
class Mask:
    """A CK attention mask: ``left``/``right`` window sides (-1 = unlimited) and alignment."""

    left: int = -1
    right: int = -1
    top_left: bool = True
    sink: int = 0

    def __post_init__(self):
        if isinstance(self.sink, bool) or not isinstance(self.sink, (int, np.integer)):
            raise TypeError(f"mask sink must be an int, got {type(self.sink).__name__}")
        if not 0 <= self.sink < _NO_LIMIT:
            raise ValueError(f"mask sink (sink tokens) must be in [0, {_NO_LIMIT}), got {self.sink}")
        object.__setattr__(self, "sink", int(self.sink))
        for name in ("left", "right"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
                raise TypeError(f"mask {name} must be an int, got {type(val).__name__}")
            if val < -1:
                raise ValueError(f"mask {name} must be >= -1 (-1 = unlimited), got {val}")
            if val >= 2**63:
                raise ValueError(f"mask {name} = {val} fits no 64-bit integer (use -1 for unlimited)")
            # a side reaching past every length the int32 plan descriptors hold is unlimited (as a
            # value it would wrap there: b:2147483647,0 used to differ from b)
            object.__setattr__(self, name, -1 if val >= _NO_LIMIT else int(val))
        object.__setattr__(self, "top_left", bool(self.top_left))

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def none(cls) -> "Mask":
        """No masking: every row sees every key."""
        return cls(-1, -1, True)

    @classmethod
    def causal(cls, top_left: bool = False) -> "Mask":
        """Causal: ``j <= i`` (top-left) or ``j <= i + Sk - Sq`` (bottom-right, the default)."""
        return cls(-1, 0, top_left)

    @classmethod
    def window(cls, left: int, right: int, top_left: bool = False, sink: int = 0) -> "Mask":
        """Sliding window: ``i - left <= j <= i + right``, shifted by ``Sk - Sq`` unless top-left;
        ``sink``: the first keys seen beside it (module docstring)."""
        return cls(left, right, top_left, sink)

    @classmethod
    def from_str(cls, text: str) -> "Mask":
        """Parse CK's example mask strings: ``0``, ``t``/``1``, ``b``/``2``, ``t:l,r``, ``b:l,r``,
        ``xt:w``, ``xb:w`` (xformers window: ``w <= 0`` is causal, as in CK's ``mask.hpp``, else
        ``l = w // 2``, ``r = w - 1 - l``); ``t:l,r,s`` / ``b:l,r,s`` add ``s`` sink tokens."""
        if not isinstance(text, str):
            raise TypeError(f"mask string must be a str, got {type(text).__name__}")
        s = text.strip()
        if s == "0":
            return cls.none()
        if s in ("t", "1"):
            return cls.causal(top_left=True)
        if s in ("b", "2"):
            return cls.causal(top_left=False)
        if len(s) > 64:  # int() of a longer number is slow, or refused by Python's digit limit
            raise ValueError(f"mask string of {len(s)} characters: a CK mask string is at most 64")
        m = re.fullmatch(r"([tb]):(-?\d+),(-?\d+)(?:,(\d+))?", s)
        if m:
            left, right = int(m.group(2)), int(m.group(3))
            if left < -1 or right < -1:
                raise ValueError(f"mask {text!r}: window sides must be >= -1")
            return cls(left, right, m.group(1) == "t", int(m.group(4) or 0))
        m = re.fullmatch(r"x([tb]):(-?\d+)", s)
        if m:
            top_left, w = m.group(1) == "t", int(m.group(2))
            if w <= 0:  # CK's mask.hpp: a window only when window_size > 0, else causal
                return cls.causal(top_left)
            left = w // 2
            return cls(left, w - 1 - left, top_left)
        raise ValueError(
            f"mask {text!r} is not a CK mask string (expected 0, t, b, 1, 2, t:l,r, b:l,r, t:l,r,s, b:l,r,s, xt:w or xb:w)"
        )

    # -- properties -----------------------------------------------------------------------------
    @property
    def is_none(self) -> bool:
        return self.left < 0 and self.right < 0

    @property
    def kind(self) -> str:
        """A short name: ``none``, ``causal`` or ``window``."""
        if self.is_none:
            return "none"
        if self.left < 0 and self.right == 0:
            return "causal"
        return "window"

    def __str__(self) -> str:
        if self.is_none and not self.sink:
            return "0"
        return f"{'t' if self.top_left else 'b'}:{self.left},{self.right}" + (f",{self.sink}" if self.sink else "")

    @property
    def window_only(self) -> "Mask":
        """This mask without its sink tokens (what the kernels apply)."""
        return dataclasses.replace(self, sink=0) if self.sink else self

    # -- semantics ------------------------------------------------------------------------------
    def coords(self, sq: int, sk: int) -> tuple[int, int]:
        """CK's (y, x) for a problem of ``sq`` rows and ``sk`` keys (see module docstring)."""
        left, right = self.left, self.right
        if self.is_none:
            # Every key visible; y, x chosen so the window covers everything.
            return sq + sk + 1, sk + 1
        if left < 0:
            left = sq - 1 if self.top_left else sk - 1
        if right < 0:
            right = sk - 1 if self.top_left else sq - 1
        x = 1 + right + (0 if self.top_left else sk - sq)
        y = 1 + left + (0 if self.top_left else sq - sk)
        return y, x

    def clipped_coords(self, sq: int, sk: int) -> tuple[int, int]:
        """``coords`` clipped to ``y`` in ``[-sk, sq + 1]``, ``x`` in ``[-sq, sk + 1]``: the same
        visibility for every row and key of the problem, in a range any integer type holds."""
        y, x = self.coords(sq, sk)
        return int(min(max(y, -sk), sq + 1)), int(min(max(x, -sq), sk + 1))

    def tile_range(self, i0, rows: int, sq, sk, n0: int):
        """CK's ``GetTileRangeAlongX``: the key range ``[lo, hi)``, in multiples of ``n0`` (``hi``
        clipped to ``sk``), that rows ``i0 .. i0+rows-1`` may see; ``lo >= hi`` means none.
        Works elementwise on numpy arrays of tile starts and lengths."""
        y, x = self.coords(sq, sk)
        lo = np.maximum(i0 - y + 1, 0) // n0 * n0
        hi = np.minimum(i0 + rows - 1 + x, sk)
        hi = np.minimum(-(-hi // n0) * n0, sk)
        return lo, hi

    def visible_pairs(self, sq: int, sk: int) -> int:
        """How many query-key pairs of a problem of ``sq`` rows and ``sk`` keys are visible,
        counted row by row (row ``i`` sees ``max(i - y + 1, 0) <= j < min(i + x, sk)``)."""
        y, x = self.clipped_coords(sq, sk)
        i = np.arange(sq, dtype=np.int64)
        return int(np.maximum(np.minimum(i + x, sk) - np.maximum(i - y + 1, 0), 0).sum())

    def materialize(self, sq: int, sk: int) -> np.ndarray:
        """The ``[sq, sk]`` boolean visibility matrix, for tests and debugging only."""
        y, x = self.coords(sq, sk)
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        hi = np.minimum(i + x, sk)
        return ((j >= i - y + 1) | (j < self.sink)) & (j < hi)


def as_mask(mask) -> Mask:
    """Normalize the ``mask`` argument: None, a CK string, or a :class:`Mask`."""
    if mask is None:
        return Mask.none()
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, str):
        return Mask.from_str(mask)
    raise TypeError(f"mask must be None, a CK mask string or a fmha_iree.Mask, got {type(mask).__name__}")
