"""The host region as a torch tensor, pinned for DMA when CUDA is present."""

from __future__ import annotations

import logging

import torch

from kvfs.host_region import HostRegion

log = logging.getLogger(__name__)


def host_tensor(region: HostRegion) -> torch.Tensor:
    """A uint8 tensor of shape (num_slots, slot_bytes) over the region, sharing its memory."""
    flat = torch.frombuffer(region.view.cast("B"), dtype=torch.uint8)
    return flat.view(region.num_slots, region.slot_bytes)


def pin(tensor: torch.Tensor) -> bool:
    """Register host memory that torch did not allocate as pinned, so copies to and from the
    device are asynchronous DMA. False (copies still work, synchronously) without CUDA or
    when the driver refuses."""
    if not torch.cuda.is_available() or tensor.is_pinned():
        return tensor.is_pinned()
    cudart = torch.cuda.cudart()
    # Portable (1): pinned for every CUDA context, not just the current device's.
    code = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 1))
    if code != 0:
        log.warning("cudaHostRegister failed (%s): host copies will be synchronous", code)
        return False
    return True


def unpin(tensor: torch.Tensor) -> None:
    if torch.cuda.is_available() and tensor.is_pinned():
        int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
