"""FSDP2's all-gather and reduce-scatter on host memory (gloo) without a second copy of the buffer.

Gloo implements ``all_gather_into_tensor`` with a temporary as large as its output and
``reduce_scatter_tensor`` with temporaries of about twice its input (measured with one 128 MiB
buffer: 136 MiB and 264-328 MiB more address space at the peak). FSDP2's buffers are a whole
unit's unsharded weights or gradients, so on a CPU run the largest unit (a 32k-token embedding
or head, 125 MiB at width 1024) costs up to three times its size again at the moment its
gradients are reduced, which is when a rank's memory peaks.

Both collectives are written here as one call per rank on that rank's slice of FSDP2's own
buffer, in place:

- all-gather: FSDP2 has already copied this rank's shard into its slice of the output; rank r's
  slice is broadcast from rank r;
- reduce-scatter: rank r's slice of the input is reduced (summed) onto rank r; this rank then
  copies its slice to the output. FSDP2 discards the input buffer afterwards, so the reduce may
  use it as scratch.

The same bytes cross the wire as with the single collective, in ``world`` calls; nothing larger
than one slice is allocated. Each element is reduced once, at its owner, so every rank holds the
values that owner computed. Only for gloo: NCCL's collectives allocate nothing of this size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from boost_compile import _torch_compat as compat


def _slices(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """``t`` (1-D, FSDP2's flat buffer) as ``world`` equal contiguous slices."""
    if t.dim() != 1 or t.numel() % world:
        raise ValueError(f"expected a flat buffer divisible by {world} ranks, got shape {tuple(t.shape)}")
    return list(t.view(world, -1).unbind(0))


class _HostAlloc:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class InPlaceAllGather(_HostAlloc, compat.FsdpAllGather):
    """All-gather as one broadcast per rank into FSDP2's output buffer (see the module docstring)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        world = group.size()
        parts = _slices(output_tensor, world)
        mine = parts[group.rank()]
        if input_tensor.data_ptr() != mine.data_ptr():  # FSDP2 copies in place; a caller may not
            mine.copy_(input_tensor)
        for r, part in enumerate(parts):
            dist.broadcast(part, group=group, group_src=r)
        return None


class InPlaceReduceScatter(_HostAlloc, compat.FsdpReduceScatter):
    """Reduce-scatter as one reduce per rank on FSDP2's input buffer (see the module docstring)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        world = group.size()
        parts = _slices(input_tensor, world)
        for r, part in enumerate(parts):
            dist.reduce(part, op=op, group=group, group_dst=r)
        output_tensor.copy_(parts[group.rank()].view_as(output_tensor))
        return None


def use_in_place_host_comms(modules: Sequence[Any], mesh: Any) -> bool:
    """Give every FSDP2 module the in-place collectives when ``mesh`` runs on host memory (gloo);
    returns whether it did."""
    if mesh.device_type != "cpu":
        return False
    for module in modules:
        module.set_custom_all_gather(InPlaceAllGather())
        module.set_custom_reduce_scatter(InPlaceReduceScatter())
    return True
