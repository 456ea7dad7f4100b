"""Triton kernels for RMSNorm (forward and backward), with an optional fused residual add.

    y = x_hat * (offset + w),   x_hat = x * rstd,   rstd = rsqrt(mean(x^2) + eps)

over the last dimension. Statistics and all arithmetic are fp32; ``y`` (and the
residual sum ``s``) are stored in the input dtype, ``rstd`` in fp32.

Layout of the work
------------------
Each program owns row *blocks* of ``BLOCK_M`` rows and walks them with a grid
stride (``for blk in range(pid, n_blocks, num_programs)``), so the grid can be
smaller than the number of rows (a persistent launch sized to keep about
``WARPS_PER_SM`` warps per SM). The weight is loaded once per program.

* ``SINGLE_PASS`` (``N <= BLOCK_N``): a whole row fits one block; one read of
  ``x``, one write of ``y``.
* chunked (``N > BLOCK_N``, widths up to 65536 and beyond): the forward makes two
  passes over ``BLOCK_N``-wide column chunks, the first accumulating ``sum(x^2)``
  and the second normalising (the residual sum is recomputed in the second pass
  rather than read back, so no pass reads what another thread of the program
  wrote). The backward likewise makes one pass for ``mean(g * w' * x_hat)`` and a
  second that writes ``dx``.

Weight gradient: every program accumulates its rows' ``g * x_hat`` in fp32 and
writes a partial sum into row ``pid`` of a ``[num_programs, N]`` fp32 buffer; the
caller sums that buffer over programs. The chunked backward adds into its own
buffer row with relaxed atomics (no contention: only program ``pid`` touches row
``pid``, so there is no race between programs and no read-back of a plain store).

The launchers ``rmsnorm_fwd_triton`` / ``rmsnorm_bwd_triton`` are plain Python
functions: with ``TRITON_INTERPRET=1`` set before this module is imported they
run on CPU tensors through Triton's interpreter (that is how the tests check
the kernels without a GPU).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Widest column block a program holds in registers; wider rows use the chunked loop.
MAX_BLOCK_N = 8192
#: Target number of elements (rows x columns) a program processes per iteration.
TARGET_BLOCK_ELEMS = 4096
#: Warps per SM the persistent launch aims for (CUDA): programs = SMs * this / num_warps.
WARPS_PER_SM = 32
#: Programs used when the tensors are not on CUDA (the interpreter).
CPU_PROGRAMS = 4


@triton.jit
def _rmsnorm_fwd_kernel(
    X, R, W, Y, S, RSTD,
    stride_x, stride_r, stride_y, stride_s,
    n_rows, N, eps, offset,
    HAS_W: tl.constexpr,
    HAS_RES: tl.constexpr,
    CAST_BEFORE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cols2 = cols[None, :]
    if SINGLE_PASS:
        cmask = cols2 < N
        if HAS_W:
            w = tl.load(W + cols2, mask=cmask, other=0.0).to(tl.float32) + offset
    for blk in range(pid, n_blocks, nprog):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        if SINGLE_PASS:
            m = rmask[:, None] & cmask
            x = tl.load(X + rows64 * stride_x + cols2, mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(R + rows64 * stride_r + cols2, mask=m, other=0.0).to(tl.float32)
                s = (x + r).to(S.dtype.element_ty)
                tl.store(S + rows64 * stride_s + cols2, s, mask=m)
                x = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
            tl.store(RSTD + rows, rstd, mask=rmask)
            y = x * rstd[:, None]
            if CAST_BEFORE_W:
                y = y.to(Y.dtype.element_ty).to(tl.float32)
            if HAS_W:
                y = y * w
            tl.store(Y + rows64 * stride_y + cols2, y.to(Y.dtype.element_ty), mask=m)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                c = off + cols2
                m = rmask[:, None] & (c < N)
                x = tl.load(X + rows64 * stride_x + c, mask=m, other=0.0).to(tl.float32)
                if HAS_RES:
                    r = tl.load(R + rows64 * stride_r + c, mask=m, other=0.0).to(tl.float32)
                    s = (x + r).to(S.dtype.element_ty)
                    tl.store(S + rows64 * stride_s + c, s, mask=m)
                    x = s.to(tl.float32)
                acc += x * x
            rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
            tl.store(RSTD + rows, rstd, mask=rmask)
            for off in range(0, N, BLOCK_N):
                c = off + cols2
                cm = c < N
                m = rmask[:, None] & cm
                x = tl.load(X + rows64 * stride_x + c, mask=m, other=0.0).to(tl.float32)
                if HAS_RES:
                    r = tl.load(R + rows64 * stride_r + c, mask=m, other=0.0).to(tl.float32)
                    x = (x + r).to(S.dtype.element_ty).to(tl.float32)
                y = x * rstd[:, None]
                if CAST_BEFORE_W:
                    y = y.to(Y.dtype.element_ty).to(tl.float32)
                if HAS_W:
                    wc = tl.load(W + c, mask=cm, other=0.0).to(tl.float32) + offset
                    y = y * wc
                tl.store(Y + rows64 * stride_y + c, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rmsnorm_bwd_kernel(
    G, X, W, RSTD, GS, DX, DWP,
    stride_g, stride_x, stride_gs, stride_dx,
    n_rows, N, offset,
    HAS_W: tl.constexpr,
    HAS_GS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cols2 = cols[None, :]
    dwp_row = DWP + pid.to(tl.int64) * N
    if SINGLE_PASS:
        cmask = cols2 < N
        if HAS_W:
            w = tl.load(W + cols2, mask=cmask, other=0.0).to(tl.float32) + offset
            dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for blk in range(pid, n_blocks, nprog):
            rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            m = rmask[:, None] & cmask
            x = tl.load(X + rows64 * stride_x + cols2, mask=m, other=0.0).to(tl.float32)
            g = tl.load(G + rows64 * stride_g + cols2, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
            xh = x * rstd
            if HAS_W:
                wg = g * w
                dw_acc += g * xh
            else:
                wg = g
            c1 = tl.sum(wg * xh, axis=1)[:, None] / N
            dx = (wg - xh * c1) * rstd
            if HAS_GS:
                dx += tl.load(GS + rows64 * stride_gs + cols2, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + rows64 * stride_dx + cols2, dx.to(DX.dtype.element_ty), mask=m)
        if HAS_W:
            tl.store(dwp_row + cols, tl.sum(dw_acc, axis=0), mask=cols < N)
    else:
        for blk in range(pid, n_blocks, nprog):
            rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                c = off + cols2
                cm = c < N
                m = rmask[:, None] & cm
                x = tl.load(X + rows64 * stride_x + c, mask=m, other=0.0).to(tl.float32)
                g = tl.load(G + rows64 * stride_g + c, mask=m, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * (tl.load(W + c, mask=cm, other=0.0).to(tl.float32) + offset)
                acc += g * x
            c1 = tl.sum(acc, axis=1)[:, None] * rstd / N
            for off in range(0, N, BLOCK_N):
                c = off + cols2
                cm = c < N
                m = rmask[:, None] & cm
                x = tl.load(X + rows64 * stride_x + c, mask=m, other=0.0).to(tl.float32)
                g = tl.load(G + rows64 * stride_g + c, mask=m, other=0.0).to(tl.float32)
                xh = x * rstd
                if HAS_W:
                    wg = g * (tl.load(W + c, mask=cm, other=0.0).to(tl.float32) + offset)
                    tl.atomic_add(
                        dwp_row + off + cols,
                        tl.sum(g * xh, axis=0),
                        mask=(off + cols) < N,
                        sem="relaxed",
                    )
                else:
                    wg = g
                dx = (wg - xh * c1) * rstd
                if HAS_GS:
                    dx += tl.load(GS + rows64 * stride_gs + c, mask=m, other=0.0).to(tl.float32)
                tl.store(DX + rows64 * stride_dx + c, dx.to(DX.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- launch helpers


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as a ``[rows, n]`` view with unit column stride (a copy only when needed)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, n)


def _block_sizes(
    n: int, block_n: int | None, max_block_n: int, block_m: int | None
) -> tuple[int, int, bool]:
    if block_n is None:
        block_n = min(triton.next_power_of_2(n), triton.next_power_of_2(max_block_n))
    elif block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    if block_m is None:
        block_m = max(1, min(16, TARGET_BLOCK_ELEMS // block_n)) if block_n >= n else 1
    elif block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    return block_n, block_m, block_n >= n


def _default_num_warps(block_m: int, block_n: int) -> int:
    return max(1, min(16, (block_m * block_n) // 512))


def _grid(n_blocks: int, device: torch.device, num_programs: int | None, num_warps: int) -> int:
    if num_programs is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            num_programs = _sm_count(index) * max(1, WARPS_PER_SM // num_warps)
        else:
            num_programs = CPU_PROGRAMS
    return max(1, min(n_blocks, num_programs))


def rmsnorm_fwd_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    *,
    residual: torch.Tensor | None = None,
    cast_before_weight: bool = False,
    block_n: int | None = None,
    max_block_n: int = MAX_BLOCK_N,
    block_m: int | None = None,
    num_programs: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel. Returns ``(y, rstd, s)``.

    ``x`` may have any number of leading dimensions and any strides (a last dim
    with stride != 1 is made contiguous first). ``y`` has ``x``'s shape and dtype
    (contiguous), ``rstd`` is fp32 of shape ``x.shape[:-1]``; ``s = x + residual``
    (in ``x``'s dtype) when ``residual`` is given, else ``None`` -- and then the
    statistics are those of ``s``. The tuning keywords (``block_n`` columns per
    chunk, ``max_block_n`` cap on it, ``block_m`` rows per block, ``num_programs``
    grid size, ``num_warps``) default to heuristics.
    """
    n = x.shape[-1]
    if weight is not None and weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match width {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    s = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = _rows2d(x, n)
    rows = x2.shape[0]
    if rows == 0 or n == 0:
        if n == 0:
            rstd.fill_(float("nan"))  # mean over an empty row, as ATen computes it
        return y, rstd, s
    bn, bm, single = _block_sizes(n, block_n, max_block_n, block_m)
    num_warps = num_warps or _default_num_warps(bm, bn)
    grid = _grid(triton.cdiv(rows, bm), x.device, num_programs, num_warps)
    y2 = y.view(-1, n)
    r2 = _rows2d(residual, n) if residual is not None else x2
    s2 = s.view(-1, n) if s is not None else y2
    w = weight.contiguous() if weight is not None else x2
    _rmsnorm_fwd_kernel[(grid,)](
        x2, r2, w, y2, s2, rstd,
        x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
        rows, n, float(eps), float(offset),
        HAS_W=weight is not None,
        HAS_RES=residual is not None,
        CAST_BEFORE_W=bool(cast_before_weight),
        BLOCK_M=bm,
        BLOCK_N=bn,
        SINGLE_PASS=single,
        num_warps=num_warps,
    )  # fmt: skip
    return y, rstd, s


def rmsnorm_bwd_triton(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float = 0.0,
    *,
    grad_s: torch.Tensor | None = None,
    block_n: int | None = None,
    max_block_n: int = MAX_BLOCK_N,
    block_m: int | None = None,
    num_programs: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel. Returns ``(dx, dw)``.

    ``x`` is the normalised input (``s`` for the residual form) and ``rstd`` the
    forward's fp32 reciprocal RMS. ``grad_s``, when given, is added to ``dx`` (the
    gradient reaching ``s`` directly). ``dx`` has ``x``'s shape and dtype
    (contiguous); ``dw`` has ``weight``'s dtype, or is ``None`` without a weight.
    """
    n = x.shape[-1]
    if grad_y.shape != x.shape:
        raise ValueError(f"grad shape {tuple(grad_y.shape)} does not match {tuple(x.shape)}")
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = _rows2d(x, n)
    rows = x2.shape[0]
    if rows == 0 or n == 0:
        if grad_s is not None:
            dx.copy_(grad_s)
        else:
            dx.zero_()
        dw = None if weight is None else torch.zeros_like(weight)
        return dx, dw
    bn, bm, single = _block_sizes(n, block_n, max_block_n, block_m)
    num_warps = num_warps or _default_num_warps(bm, bn)
    grid = _grid(triton.cdiv(rows, bm), x.device, num_programs, num_warps)
    g2 = _rows2d(grad_y, n)
    dx2 = dx.view(-1, n)
    gs2 = _rows2d(grad_s, n) if grad_s is not None else g2
    rstd1 = rstd.reshape(-1).contiguous()
    if rstd1.dtype != torch.float32:
        raise ValueError(f"rstd must be float32, got {rstd.dtype}")
    if weight is not None:
        w = weight.contiguous()
        # The chunked kernel accumulates into its buffer row with atomics: start from zero.
        alloc = torch.empty if single else torch.zeros
        dwp = alloc((grid, n), dtype=torch.float32, device=x.device)
    else:
        w = dwp = x2
    _rmsnorm_bwd_kernel[(grid,)](
        g2, x2, w, rstd1, gs2, dx2, dwp,
        g2.stride(0), x2.stride(0), gs2.stride(0), dx2.stride(0),
        rows, n, float(offset),
        HAS_W=weight is not None,
        HAS_GS=grad_s is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        SINGLE_PASS=single,
        num_warps=num_warps,
    )  # fmt: skip
    dw = None if weight is None else dwp.sum(0).to(weight.dtype)
    return dx, dw
