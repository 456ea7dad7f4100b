"""Hand-written fused kernels, exposed as ``torch.library`` custom ops (namespace ``boost``).

    from boost_compile.kernels import rms_norm
    y = rms_norm(x, weight, 1e-6)                        # Llama: x_hat * w
    y = rms_norm(x, weight, 1e-6, offset=1.0)            # Gemma: x_hat * (1 + w)
    s, y = rms_norm(x, weight, 1e-6, residual=h)         # s = x + h, y = norm(s)

On CUDA the ops launch Triton kernels; on other devices they run ATen code.
The Triton launchers live in :mod:`boost_compile.kernels.rmsnorm_triton`.
"""

from boost_compile.kernels.rmsnorm import (
    HAS_TRITON,
    add_rms_norm_op,
    rms_norm,
    rms_norm_backward_op,
    rms_norm_op,
    rms_norm_reference,
)

__all__ = [
    "HAS_TRITON",
    "add_rms_norm_op",
    "rms_norm",
    "rms_norm_backward_op",
    "rms_norm_op",
    "rms_norm_reference",
]
