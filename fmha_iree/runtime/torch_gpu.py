"""torch tensors on a GPU in and out of a call without a host round trip (DLPack).

A call given torch GPU tensors runs on the IREE device of the same GPU (``cuda://N``; ``hip://N``
under a ROCm build of torch, which names its GPUs ``cuda`` too) unless ``device`` names it. The
tensors are shared with IREE as they are (a non-contiguous one is made contiguous by torch on the
GPU first) and the results come back as torch tensors on that GPU viewing IREE's buffers
(``torch.from_dlpack``).

Ordering: IREE 3.13 runs each device on a stream of its own and cannot wait on a CUDA event (its
CUDA HAL leaves ``import_timepoint`` unimplemented), so the call first waits on the host for
torch's current stream on that GPU (what torch queued before the call is then written), and the
results are handed to torch once IREE has finished them (the export waits on the host for the
call's fence): whatever torch queues after the call reads finished results and may overwrite the
inputs. Where IREE cannot export a result (its stream-ordered pool allocations,
``FMHA_IREE_CUDA_CACHE_BYTES=0``), it is copied to the GPU through host memory. (Ordering the two
streams on the device instead, through flags in device memory, was built and measured:
``docs/tried.md``, "torch CUDA tensors ordered on the device".)
"""

from __future__ import annotations

import dataclasses

from .device import DLPACK_DTYPES, DeviceTensor

__all__ = ["TorchGpu", "torch_gpu", "TorchCall"]


@dataclasses.dataclass(frozen=True)
class TorchGpu:
    """The GPU a call's torch tensors live on: the IREE device URI and torch's device."""

    uri: str
    device: object  # torch.device


def _is_gpu_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and getattr(getattr(x, "device", None), "type", None) == "cuda"


def torch_gpu(named: dict, device) -> TorchGpu | None:
    """The GPU of the torch GPU tensors among ``named`` (argument name -> value), or None when
    there are none; ``ValueError`` naming the argument when they live on different GPUs, beside
    torch CPU tensors, or on another device than ``device`` names."""
    gpus = {n: x for n, x in named.items() if _is_gpu_tensor(x)}
    if not gpus:
        return None
    first, x0 = next(iter(gpus.items()))
    for n, x in gpus.items():
        if x.device != x0.device:
            raise ValueError(f"{n} is on {x.device} but {first} on {x0.device}: one GPU per call")
    for n, x in named.items():
        if type(x).__module__.startswith("torch") and hasattr(x, "device") and n not in gpus:
            raise ValueError(f"{n} is on {x.device} but {first} on {x0.device}: move both to one device")
    import torch

    driver = "hip" if getattr(torch.version, "hip", None) else "cuda"
    index = x0.device.index if x0.device.index is not None else torch.cuda.current_device()
    uri = f"{driver}://{index}"
    if device is not None and (not isinstance(device, str) or device.strip() != uri):
        raise ValueError(f"{first} is on {x0.device} (IREE device {uri!r}) but device is {device!r}")
    return TorchGpu(uri, torch.device("cuda", index))


class TorchCall:
    """One call's torch GPU tensors: :meth:`inputs` before the call, :meth:`outputs` after it."""

    def __init__(self, gpu: TorchGpu):
        self.gpu = gpu

    def inputs(self, values: tuple) -> tuple:
        """``values`` with each torch GPU tensor shared as a DeviceTensor (a non-contiguous one
        copied by torch first), after torch's current stream on that GPU has finished; anything
        else unchanged."""
        import torch

        values = tuple(x.detach().contiguous() if _is_gpu_tensor(x) else x for x in values)
        torch.cuda.current_stream(self.gpu.device).synchronize()
        return tuple(self._share(x) if _is_gpu_tensor(x) else x for x in values)

    def _share(self, x) -> DeviceTensor:
        from torch.utils.dlpack import to_dlpack

        dtype = DLPACK_DTYPES.get(str(x.dtype))
        if dtype is None:  # refused by name, as a DLPack import refuses it
            return DeviceTensor.from_dlpack(x, self.gpu.uri)
        return DeviceTensor.from_capsule(to_dlpack(x), self.gpu.uri, x.shape, dtype, x)

    def outputs(self, result):
        """The call's result (a DeviceTensor or a tuple of them) as torch tensors on the GPU,
        once IREE has written them."""
        if isinstance(result, tuple):
            return tuple(self.outputs(r) for r in result)
        if not isinstance(result, DeviceTensor):
            return result
        import torch

        try:
            return torch.from_dlpack(result)  # DeviceTensor.__dlpack__ waits for the contents
        except TypeError:  # memory IREE cannot export: through the host
            return result.to_torch().to(self.gpu.device)
