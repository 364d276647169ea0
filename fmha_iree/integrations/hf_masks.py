"""Reading transformers' 4-D attention masks for the fmha_iree backend (``integrations.hf``): as
one CK mask for the whole batch (:func:`ck_mask`), as a padded batch of one sequence per row
(:func:`padded_batch`, group mode), or, where neither says it, as an elementwise bias
(:class:`MaskBias`); :data:`MASK_PLANS` reads a mask once per forward pass."""

from __future__ import annotations

import dataclasses
import threading
import weakref

import numpy as np
import torch

from . import torch_ops
from ..problem.mask import Mask

__all__ = ["MASK_PLANS", "MaskPlans", "MaskBias", "ck_mask", "padded_batch", "PaddedBatch"]

class MaskPlans:
    """The plan (:func:`_plan`) of the last 4-D mask read, by identity and version counter:
    transformers hands every layer of a forward pass the same mask tensor, so it is read once per
    pass (inference-mode tensors, which track no version, are read every time)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: tuple = ()  # (weakref to the mask, its _version, Sq, Sk, plan)

    def get(self, attention_mask, sq: int, sk: int):
        try:
            version = attention_mask._version
        except (AttributeError, RuntimeError):  # inference tensors track no version
            version = None
        with self._lock:
            last = self._last
        if version is not None and last and last[0]() is attention_mask and last[1:4] == (version, sq, sk):
            return last[4]
        try:
            plan = _plan(_visible_4d(attention_mask, sq, sk))
        except ValueError:
            if attention_mask.ndim != 4 or tuple(attention_mask.shape[-2:]) != (sq, sk):
                raise
            plan = MaskBias(attention_mask)  # no CK mask or padded batch says it: read it as a bias
        if version is not None:
            with self._lock:
                self._last = (weakref.ref(attention_mask), version, sq, sk, plan)
        return plan


MASK_PLANS = MaskPlans()


class MaskBias:
    """A 4-D mask no CK mask or padded batch expresses, as an elementwise bias ``[B, 1 or H, Sq,
    Sk]`` (boolean: 0 where it attends, ``-inf`` elsewhere; float: as given), made once per dtype
    (every layer of a pass shares it)."""

    def __init__(self, mask: torch.Tensor):
        self._mask = mask.detach()
        self._made: dict = {}

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._made:
            self._made[dtype] = torch_ops.additive_bias(self._mask, dtype)
        return self._made[dtype]


def ck_mask(attention_mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int) -> str:
    """The CK mask string of a transformers attention mask shared by the whole batch.

    ``None``: ``"b"`` (bottom-right causal) when ``is_causal`` and ``Sq > 1``, else ``"0"``. A 4-D
    ``[B, 1 or H, Sq, Sk]`` mask, boolean (True: attend) or additive float (0 and -inf / the dtype's
    minimum), must be the same for every batch row and head and one window per row
    (:func:`fmha_iree.integrations.torch_ops.mask_of`, top-left or bottom-right); masks that differ between
    batch rows (padding: see :func:`padded_batch`, which :func:`attention_forward` tries then),
    and other patterns, are a ``ValueError`` naming ``attention_mask``."""
    if attention_mask is None:
        return "b" if is_causal and sq > 1 else "0"
    return _plan(_visible_4d(attention_mask, sq, sk), padded=False)


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """A padded batch read back from its 4-D mask (:func:`padded_batch`): batch row ``b`` is one
    sequence of query rows ``q_start[b] .. q_end[b] - 1`` and keys ``k_start[b] .. k_end[b] - 1``
    (padded coordinates, end exclusive; an empty run where the row sees no key), which sees
    exactly what the mask shows through the CK mask ``mask``, applied per sequence with its own
    lengths (``"b"``: each sequence's last query sits on its last key)."""

    mask: str
    sq: int
    sk: int
    q_start: tuple[int, ...]
    q_end: tuple[int, ...]
    k_start: tuple[int, ...]
    k_end: tuple[int, ...]

    def varlen_starts(self):
        """``(seqstart_q, seqstart_k, seqstart_padded_q, seqstart_padded_k)``, int32 tensors for
        ``fmha_fwd_varlen`` over the batch flattened to ``B*Sq`` query and ``B*Sk`` key tokens (the
        batch rows that see some key, in order), or None when no row sees any key."""
        rows = [b for b in range(len(self.q_start)) if self.q_end[b] > self.q_start[b]]
        if not rows:
            return None
        nq = [self.q_end[b] - self.q_start[b] for b in rows]
        nk = [self.k_end[b] - self.k_start[b] for b in rows]
        total_q, total_k = len(self.q_start) * self.sq, len(self.q_start) * self.sk

        def tensor(xs):
            return torch.tensor(xs, dtype=torch.int32)

        return (tensor(np.concatenate([[0], np.cumsum(nq)])), tensor(np.concatenate([[0], np.cumsum(nk)])),
                tensor([b * self.sq + self.q_start[b] for b in rows] + [total_q]),
                tensor([b * self.sk + self.k_start[b] for b in rows] + [total_k]))


def padded_batch(attention_mask: torch.Tensor, sq: int, sk: int) -> PaddedBatch:
    """Read a padded batch's 4-D mask (``[B, 1 or H, Sq, Sk]``, boolean or additive float, the same
    for every head) back into one sequence per batch row (:class:`PaddedBatch`).

    Row ``b``'s keys are the keys any of its queries sees, which must be one contiguous run
    ``[k0, k1)`` (left padding, with or without a KV cache; right padding before any token is
    appended: ``generate`` appends after the padding, a hole); its queries are the rows
    from the first to the last that sees a key; over those runs every batch row must be the same
    CK window (causal, bottom-right or top-left, or a sliding window; checked exactly against the
    mask), so that group mode with that mask sees exactly what the mask shows in every row. Rows
    outside the query run see no key. Left padding (prefill, a KV-cache chunk, decode): ``"b"``
    over ``[p_b, Sk)``. Right padding: every query row (its pad rows see the whole sequence, as
    in the mask) over ``[0, L_b)``, top-left ``"t"``. Anything else (a hole in a row's padding,
    masks differing between heads, chunked attention, biases) is a ``ValueError`` naming
    ``attention_mask``."""
    return _plan(_visible_4d(attention_mask, sq, sk), shared=False)


def _visible_4d(attention_mask, sq: int, sk: int) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be None or a 4-D torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 4 or tuple(attention_mask.shape[-2:]) != (sq, sk):
        raise ValueError(f"attention_mask must be [B, 1 or H, Sq, Sk] with Sq, Sk = {sq}, {sk}, got "
                         f"{list(attention_mask.shape)}")
    return _visible(attention_mask)


def _plan(vis: torch.Tensor, shared: bool = True, padded: bool = True):
    """A CK mask string (one mask for the whole batch, when ``shared``) or a :class:`PaddedBatch`
    (when ``padded``) for a boolean ``[B, H, Sq, Sk]`` visibility mask."""
    _, _, sq, sk = vis.shape
    if vis.shape[1] > 1 and not bool((vis == vis[:, :1]).all()):
        raise ValueError("attention_mask differs between heads: the fmha_iree attention takes one mask for every head; "
                         "use attn_implementation='sdpa'")
    rows = vis[:, 0]
    same = rows.shape[0] == 1 or bool((rows == rows[:1]).all())
    if shared and same:
        try:
            return torch_ops.mask_of(rows[0], False, sq, sk)
        except ValueError as e:
            if not padded:
                raise ValueError(f"attention_mask: {e}") from None
            # one padded row (or every row padded alike): try it as a padded batch
    if not padded:
        raise ValueError("attention_mask differs between batch rows (padding): ck_mask takes one mask for the whole "
                         "batch; padded_batch (what attention_forward tries then) reads one sequence per row")
    return _padded(rows)


def _span(x: torch.Tensor):
    """First and one-past-last True index of each row of a boolean ``[B, N]`` (0, 0 where none),
    and whether the Trues between them are all True; as lists."""
    n = x.shape[1]
    idx = torch.arange(n)
    count = x.sum(1)
    first = torch.where(count > 0, torch.where(x, idx, n).amin(1), 0)
    end = torch.where(x, idx + 1, 0).amax(1)
    return first.tolist(), end.tolist(), (count == end - first).tolist()


def _padded(rows: torch.Tensor) -> PaddedBatch:
    """:func:`padded_batch` of a boolean ``[B, Sq, Sk]``. Each query row's keys must be one run
    (``first``, ``count``: a few passes over the mask); the runs and the CK candidates are then
    worked out on ``[B, Sq]`` vectors, and a candidate is taken only if it gives every row of every
    batch row exactly its run."""
    nb, sq, sk = rows.shape
    k0, k1, contiguous = _span(rows.any(1))
    for b in range(nb):
        if not contiguous[b]:
            seen = set(torch.nonzero(rows[b].any(0)).flatten().tolist())
            hole = next(j for j in range(k0[b], k1[b]) if j not in seen)
            raise ValueError(f"attention_mask: batch row {b} sees keys {k0[b]}..{k1[b] - 1} but no query sees key "
                             f"{hole} between them (a hole in the padding mask): the fmha_iree attention takes one "
                             "contiguous run of keys per batch row; use attn_implementation='sdpa'")
    u8 = rows.to(torch.uint8)
    count = u8.sum(2, dtype=torch.int64)  # [B, Sq]: keys each query row sees
    first = u8.argmax(2)  # its first key (argmax gives the first maximum)
    runs = u8[:, :, 0] + (rows[:, :, 1:] > rows[:, :, :-1]).sum(2, dtype=torch.int32)
    if bool((runs > 1).any()):
        b, i = torch.nonzero(runs > 1)[0].tolist()
        raise ValueError(f"attention_mask: query row {i} of batch row {b} sees more than one run of keys: the "
                         "fmha_iree attention takes a causal mask or a sliding window over one run of keys per batch "
                         "row; use attn_implementation='sdpa'")
    q0, q1, _ = _span(count > 0)
    nq = torch.tensor(q1) - torch.tensor(q0)  # [B]
    nk = torch.tensor(k1) - torch.tensor(k0)
    i = torch.arange(sq)[None, :] - torch.tensor(q0)[:, None]  # [B, Sq]: the row inside its sequence
    lo = first - torch.tensor(k0)[:, None]  # its first key inside the sequence's keys
    hi = lo + count
    sees = count > 0
    present = nq > 0

    def fits(mask: Mask) -> bool:
        coords = [mask.coords(int(a), int(c)) if p else (0, 0) for a, c, p in zip(nq, nk, present)]
        y = torch.tensor([c[0] for c in coords])[:, None]
        x = torch.tensor([c[1] for c in coords])[:, None]
        want_lo = torch.clamp(i - y + 1, min=0)
        want_hi = torch.minimum(i + x, nk[:, None])
        inside = (i >= 0) & (i < nq[:, None])
        want = inside & (want_hi > want_lo)
        return bool(torch.equal(want, sees)) and bool(((want_lo == lo) & (want_hi == hi))[sees].all())

    candidates = [Mask.none()]
    for top_left in (False, True):  # bottom-right first: the one left padding and KV caches need
        d = torch.zeros_like(nk) if top_left else nk - nq
        # the widest reach of any row to the left (right) of its diagonal, or unlimited (as mask_of)
        left = max(int(torch.where(sees, i + d[:, None] - lo, 0).max()), 0) if sq else 0
        right = max(int(torch.where(sees, hi - 1 - i - d[:, None], 0).max()), 0) if sq else 0
        candidates += [Mask(a, c, top_left) for c in (right, -1) for a in (-1, left)]
    for mask in candidates:
        if fits(mask):
            text = str(mask)
            text = {"b:-1,0": "b", "t:-1,0": "t"}.get(text, text)
            return PaddedBatch(text, sq, sk, tuple(q0), tuple(q1), tuple(k0), tuple(k1))
    raise ValueError("attention_mask: the batch rows are not one CK mask (causal or a sliding window, top-left or "
                     "bottom-right, the same for every row) over each row's run of keys; use "
                     "attn_implementation='sdpa'")


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (True: attend) copy of a boolean or additive float mask, on the CPU."""
    mask = mask.detach().cpu()
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise TypeError(f"attention_mask must be boolean or floating point, got {mask.dtype}")
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | masked).all()):
        raise ValueError("attention_mask: an additive float mask with values other than 0 and -inf (a bias) is not "
                         "taken by the fmha_iree attention; use attn_implementation='sdpa'")
    return ~masked
