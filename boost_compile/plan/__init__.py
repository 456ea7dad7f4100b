"""The layout planner: which TP x PP x DP, ZeRO or FSDP2, micro-batches, schedule and checkpointing for a job.

- :mod:`~boost_compile.plan.model`: the model's shapes and parameters, without building it;
- :mod:`~boost_compile.plan.memory`: bytes per device of a layout, by term;
- :mod:`~boost_compile.plan.timing`: the step time (the scale model, recompute, ZeRO-1, FSDP2, schedule);
- :mod:`~boost_compile.plan.search`: every layout boost-train accepts, priced and ranked;
- :mod:`~boost_compile.plan.cli`: ``boost-plan``; boost-train's ``parallel=auto`` runs the same search.
"""

from boost_compile.plan.memory import Memory, memory
from boost_compile.plan.model import ModelSpec, from_hf_config, from_preset
from boost_compile.plan.search import Job, Layout, PlanError, Row, best, search

__all__ = ["Job", "Layout", "Memory", "ModelSpec", "PlanError", "Row", "best", "from_hf_config", "from_preset", "memory", "search"]
