"""Tensor parallelism: ``parallelize_`` shards a model, the backend inserts collectives."""

from boost_compile.distributed.parallelize import (
    PLANS,
    ParallelizeError,
    ShardSpec,
    TPReport,
    full_tensor,
    gather_full_grads,
    gather_full_state_dict,
    parallelize_,
)

__all__ = [
    "PLANS",
    "ParallelizeError",
    "ShardSpec",
    "TPReport",
    "full_tensor",
    "gather_full_grads",
    "gather_full_state_dict",
    "parallelize_",
]
