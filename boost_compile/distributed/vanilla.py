"""The ``"vanilla"`` tensor-parallel plan: the low-rank baseline, each factor pair
its own Megatron chunk (down column-parallel on r, up row-parallel on r), laid
out with PyTorch's DTensor ``parallelize_module``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from boost_compile.distributed.shard import ParallelizeError
from boost_compile.distributed.tp_roles import Roles


def apply_vanilla(model: nn.Module, roles: Roles, tp: Any, group: dist.ProcessGroup, vocab_parallel: bool) -> None:
    """Each factor pair as its own Megatron chunk, with PyTorch's DTensor plans."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if not roles.chains:
        raise ParallelizeError("plan vanilla is the low-rank baseline; this model has no bottlenecks")
    mesh = tp if isinstance(tp, DeviceMesh) else DeviceMesh.from_group(group, device_type="cpu")
    if mesh.ndim != 1:
        mesh = mesh["tp"]
    layout_plan: dict[str, Any] = {}
    if vocab_parallel:  # PyTorch's loss-parallel layout: logits stay a DTensor sharded on V
        from torch.distributed.tensor import Shard

        for weight, layout, _bias in roles.heads:
            if layout != "out_in":
                raise ParallelizeError(f"plan vanilla with vocab_parallel needs the head {weight} as an nn.Linear")
            layout_plan[weight.rsplit(".", 1)[0]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for down, down_layout, up, up_layout in roles.chains:
        if down_layout != "out_in" or up_layout != "out_in":
            raise ParallelizeError("plan vanilla needs the factors as nn.Linear modules")
        layout_plan[down.rsplit(".", 1)[0]] = ColwiseParallel()
        layout_plan[up.rsplit(".", 1)[0]] = RowwiseParallel()
    parallelize_module(model, mesh, layout_plan)
    model._boost_tp_plan = "vanilla"
