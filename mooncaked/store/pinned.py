"""Page-locking the staging area for a GPU engine.

A GPU engine's pool reads and writes copy between the staging area and its KV blocks in GPU
memory. From page-locked memory the GPU's copy engine moves the bytes directly; from ordinary
pageable memory the driver first copies them through a bounce buffer of its own, at a fraction of
the bus speed. The staging area is already mapped (it may be a shared-memory segment peers map),
so it is registered in place (cudaHostRegister), not allocated pinned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def pin(tensor: torch.Tensor) -> Callable[[], None] | None:
    """Page-lock a CPU tensor's memory for CUDA copies; returns the call that unlocks it, or None where
    that cannot be (no CUDA here, or the driver refused: logged, and copies stay pageable)."""
    if not torch.cuda.is_available():
        logger.warning("pinned staging asked for, but CUDA is not available here: staging stays pageable")
        return None
    cudart = torch.cuda.cudart()
    ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    try:
        torch.cuda.check_error(cudart.cudaHostRegister(ptr, nbytes, 0))
    except RuntimeError as e:  # torch.cuda.CudaError
        logger.warning("could not page-lock %d bytes of staging (%s): copies to the GPU stay pageable", nbytes, e)
        return None
    logger.info("staging page-locked for GPU copies (%d bytes)", nbytes)

    def unpin() -> None:
        try:
            torch.cuda.check_error(cudart.cudaHostUnregister(ptr))
        except RuntimeError as e:
            logger.warning("could not unlock the staging area (%s)", e)

    return unpin
