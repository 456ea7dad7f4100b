"""Model FLOPs utilization (MFU) of a boost-train run: the live model's training FLOPs per
token (the scale model's count, :func:`~boost_compile.costmodel.flops.model_flops_per_token`)
against the devices' peak from the planner's hardware file (docs/training.md, "Model FLOPs
utilization"). The loop reports :meth:`Utilization.mfu` in each metrics row and the summary."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from boost_compile.config import ConfigError
from boost_compile.costmodel.flops import model_flops_per_token, model_flops_utilization
from boost_compile.train.config import TrainConfig
from boost_compile.train.parallel import Dist, global_numel
from boost_compile.train.validate import ModelShape

log = logging.getLogger("boost_compile.train")

#: trainer.precision -> the number format whose peak FLOP/s MFU divides by
PRECISION_DTYPES = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "fp64": "fp64"}


def matmul_weights(model: nn.Module, dev: Dist | None = None, experts_top_k: int | None = None) -> int:
    """Weights of the matmuls a token goes through: every ``nn.Linear`` (each low-rank factor is
    one; the output head too, tied or not) and Hugging Face ``Conv1D``, counted whole when this
    rank holds a tensor-parallel shard, and summed over the pipeline ranks' stages; of a mixture of
    experts' stacked matrices, the ``experts_top_k`` experts a token goes through (every expert,
    sharded by expert parallelism or not, counted once)."""
    from boost_compile.distributed.expert_parallel import experts_pattern

    def numel(p: torch.Tensor) -> int:
        return global_numel(p, dev) if dev is not None else p.numel()

    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            total += numel(module.weight)
        elif experts_top_k and experts_pattern(module):
            shard = getattr(module, "_ep_shard", None)  # sharded by expert: numel counts the whole
            experts = shard.total if shard is not None else module.num_experts
            stacked = sum(numel(p) for p in module.parameters(recurse=False) if p.dim() == 3)
            total += stacked * experts_top_k // experts
    if dev is not None and dev.pp > 1:
        return int(dev.sum_over_pp(torch.tensor(float(total), dtype=torch.float64, device=dev.device)).item())
    return total


def attention_shape(shape: ModelShape) -> tuple[int, int]:
    """(layers, heads x head_dim) of the model's attention."""
    if shape.kind == "preset":
        c = shape.llama_config
        return c.n_layers, c.n_heads * c.head_dim
    c = shape.hf_config
    head_dim = getattr(c, "head_dim", None) or shape.dim // shape.n_heads
    return int(c.num_hidden_layers), shape.n_heads * int(head_dim)


def flops_per_token(model: nn.Module, shape: ModelShape, seq: int, dev: Dist | None = None) -> float:
    """Model FLOPs of training on one token of ``model`` at sequence length ``seq`` (causal attention):
    :func:`~boost_compile.costmodel.flops.model_flops_per_token` of its live linears."""
    layers, width = attention_shape(shape)
    return model_flops_per_token(matmul_weights(model, dev, experts_top_k(shape)), layers, width, seq)


def experts_top_k(shape: ModelShape) -> int | None:
    """The experts each token goes through in a mixture-of-experts model (None: no experts)."""
    if shape.kind == "preset":
        return shape.llama_config.experts_top_k if shape.llama_config.n_experts else None
    return getattr(shape.hf_config, "num_experts_per_tok", None)


@dataclass(frozen=True)
class Utilization:
    """What MFU needs besides tokens/s: the model's FLOPs per token and, when the hardware file
    gives it for the run's dtype, one device's peak FLOP/s (else None: no MFU)."""

    flops_per_token: float
    devices: int
    peak_flops: float | None
    #: the hardware file and dtype the peak is of, or why there is none
    source: str

    def mfu(self, tokens_per_s: float) -> float | None:
        """The fraction of the devices' peak that ``tokens_per_s`` (the run's, all ranks) puts to use."""
        if self.peak_flops is None:
            return None
        return model_flops_utilization(self.flops_per_token, tokens_per_s, self.devices, self.peak_flops)


def device_peak(tc: TrainConfig, device_type: str) -> tuple[float | None, str]:
    """(one device's peak FLOP/s in ``trainer.precision``'s dtype, its hardware file and dtype), or
    (None, why not). The file is the planner's: ``parallel.hardware``, else the device's default."""
    from boost_compile.costmodel.hardware import load_hardware, peak_flops_for
    from boost_compile.train.auto_layout import default_hardware

    dtype = PRECISION_DTYPES.get(tc.trainer.precision)
    try:
        name = tc.parallel.hardware or default_hardware(device_type)
        hw = load_hardware(name)
    except (ConfigError, OSError, ValueError) as exc:
        return None, f"no hardware file ({exc})"
    peak = peak_flops_for(hw, dtype) if dtype is not None else None
    if peak is None:
        given = f"the peak of {hw.peak_dtype}" if hw.peak_dtype else "a peak of no named dtype"
        return None, (f"hardware file {name} gives {given}, not of {dtype or tc.trainer.precision} "
                      f"(trainer.precision={tc.trainer.precision}); parallel.hardware names another file")
    return peak, f"hardware file {name}, {dtype}"


def utilization(tc: TrainConfig, model: nn.Module, shape: ModelShape, dev: Dist) -> Utilization:
    """The run's :class:`Utilization` (``model``: this rank's, sharded or a pipeline's stages); rank 0
    logs the FLOPs per token and the peak, or the one line saying why MFU is not reported."""
    fpt = flops_per_token(model, shape, tc.trainer.seq, dev)
    peak, source = device_peak(tc, dev.device.type)
    if dev.is_main:
        if peak is None:
            log.info("mfu: not reported: %s", source)
        else:
            log.info("mfu: %s model FLOPs per token (forward + backward), peak %s FLOP/s per device (%s), %d device(s)",
                     f"{fpt:.4g}", f"{peak:.4g}", source, dev.world)
    return Utilization(fpt, dev.world, peak, source)
