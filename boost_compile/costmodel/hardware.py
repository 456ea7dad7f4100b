"""The scale model's hardware files: one accelerator and its interconnect, each constant with its reason.

A hardware file is JSON, ``{"field": {"value": x, "source" or "why": "..."}}``;
the bundled ones live in ``boost_compile/hardware/`` (:data:`HARDWARE_FILES`),
and any other file is named by its path. One global set of constants per file,
never one per row; none was fitted to BOOST.md's iteration times;
gemm_half_intensity comes from BOOST.md's quoted GEMM utilisations.

| constant | A100 | H200 | how it was chosen |
|---|---:|---:|---|
| allreduce_bus_bandwidth | 230 GB/s | 360 GB/s | nccl-tests ring all-reduce busbw in one NVSwitch node, ~77-80% of NVLink per direction |
| p2p_bandwidth | 200 GB/s | 300 GB/s | ~2/3 of NVLink per direction for one send/recv |
| collective_latency | 25 us | 20 us | small-message NCCL all-reduce latency inside a node |
| queued_collective_latency | - | - | not given: a collective queued behind another (ZeRO-1's broadcasts) costs \
collective_latency too, NCCL running them one after another on its stream |
| gemm_max_efficiency | 0.85 | 0.75 | large bf16 cuBLAS GEMMs: ~265 of 312 TFLOP/s (A100), ~740 of 989 (H200) |
| gemm_half_intensity | 100 FLOP/B | 132 FLOP/B | 0.64 x the ridge point (peak / HBM); gives BOOST.md's GEMM utilisation on 7B TP4: \
vanilla ~60%, BTP 71-75% |
| gemm_tile | 64 | 64 | smallest output-tile edge of the fast cuBLAS/CUTLASS bf16 kernels |
| attention_efficiency | 0.50 | 0.45 | fused causal attention forward + backward (FlashAttention-2 reports 50-73% forward on A100) |
| attention_head_dim_multiple | 32 | 32 | FlashAttention-2 kernels exist for head dims 32, 64, 96, ..., 256 |
| elementwise_efficiency | 0.70 | 0.70 | unfused PyTorch elementwise kernels reach ~70% of HBM bandwidth |
| memory_gib | 74.5 | 131.3 | the datasheet's HBM (the layout planner's memory per device) |
| internode_bus_bandwidth | 22 GB/s | 45 GB/s | ring all-reduce across nodes, one 200 / 400 Gb/s InfiniBand port per GPU (the planner) |

The H200 values are not calibrated against any measurement: they carry the A100
choices over to the H200 peaks.

``peak_flops`` is the peak of one number format (bf16 in the GPU files, fp32 in ``cpu``):
the file's optional ``"peak_dtype"``, else the one format its peak's note names. A
run's MFU divides by it only in that format (:func:`peak_flops_for`).

The ``cpu`` file (``boost-bench calibrate``) holds constants measured on the
project's machine by microbenchmarks (GEMMs and attention at the 60m shapes,
elementwise bandwidth, gloo all-reduce, send/recv and queued broadcasts); with it, ``boost-bench
scale --hardware cpu`` puts the model beside the steps ``boost-bench tp`` and
``boost-bench pp`` measured (:mod:`boost_compile.bench.compare`).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
from dataclasses import dataclass, field

DEFAULT_HARDWARE = "a100-80gb-nvlink"
HARDWARE_FILES = ("a100-80gb-nvlink", "h100", "h200", "cpu")


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its intra-node interconnect (FLOP/s, B/s, s, FLOP/B, elements)."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    allreduce_bus_bandwidth: float
    p2p_bandwidth: float
    collective_latency: float
    gemm_max_efficiency: float
    gemm_half_intensity: float
    gemm_tile: float
    attention_efficiency: float
    attention_head_dim_multiple: float
    elementwise_efficiency: float
    description: str = ""
    notes: dict[str, str] = field(default_factory=dict, compare=False)
    #: alpha of one pipeline send/recv (0: not modelled, as in the GPU files)
    p2p_latency: float = 0.0
    #: memory of one device in GiB (0: not given; the planner then needs --memory-gib)
    memory_gib: float = 0.0
    #: ring all-reduce bus bandwidth between nodes, per device (0: not given, the planner
    #: then prices a data-parallel group that spans nodes at allreduce_bus_bandwidth)
    internode_bus_bandwidth: float = 0.0
    #: seconds per collective of small collectives issued back to back, asynchronously, and
    #: waited for together (ZeRO-1's broadcasts); 0: not given, each then costs collective_latency
    queued_collective_latency: float = 0.0
    #: share of a data-parallel all-reduce's time that runs beside the backward's compute when it is
    #: issued during it (1: NCCL on its own channels); 0, not given: none, as on a CPU whose
    #: cores the step already uses
    dp_overlap: float = 0.0
    #: seconds of one rank's cold compile (empty Inductor cache) of one block graph and the rest
    #: of the step, for a per-block compile; 0: not measured for this hardware
    cold_compile_s: float = 0.0
    #: seconds each layer adds to a whole-model cold compile (``passes.unit=model``); 0: not measured
    cold_compile_per_layer_s: float = 0.0
    #: a measured file's command, date and machine (empty for datasheet files)
    measured: dict[str, str] = field(default_factory=dict, compare=False)
    #: the number format peak_flops is the peak of (one of :data:`PEAK_DTYPES`; "": not known,
    #: then no MFU is reported against it): the file's ``peak_dtype``, else the one format its
    #: peak_flops note (or, failing that, its description) names
    peak_dtype: str = ""


HARDWARE_FIELDS = (
    "peak_flops",
    "hbm_bandwidth",
    "nvlink_bandwidth",
    "allreduce_bus_bandwidth",
    "p2p_bandwidth",
    "collective_latency",
    "gemm_max_efficiency",
    "gemm_half_intensity",
    "gemm_tile",
    "attention_efficiency",
    "attention_head_dim_multiple",
    "elementwise_efficiency",
)
#: fields a hardware file may leave out (then 0)
OPTIONAL_HARDWARE_FIELDS = ("p2p_latency", "memory_gib", "internode_bus_bandwidth", "queued_collective_latency",
                            "dp_overlap", "cold_compile_s", "cold_compile_per_layer_s")
#: 0 allowed: a GEMM rate that does not fall with the arithmetic intensity (efficiency eff_max throughout)
MAY_BE_ZERO = ("gemm_half_intensity",)
#: number formats a peak FLOP/s is quoted for, as the files write them (any case)
PEAK_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
_DTYPE_WORD = re.compile(r"\b(" + "|".join(PEAK_DTYPES) + r")\b", re.IGNORECASE)


def _hardware_value(data: dict, key: str) -> tuple[float, str]:
    """One field's value and its note, checked: an object with a 'value' and a 'source' or 'why'."""
    entry = data[key]
    if not isinstance(entry, dict) or "value" not in entry:
        raise ValueError(f"hardware field {key!r} must be an object with a 'value'")
    note = entry.get("why") or entry.get("source")
    if not note:
        raise ValueError(f"hardware field {key!r} has no 'source' or 'why' note")
    return float(entry["value"]), str(note)


def hardware_from_dict(data: dict) -> Hardware:
    """A :class:`Hardware` from the JSON layout ``{"field": {"value": x, "source" or "why": "..."}}``."""
    missing = [k for k in HARDWARE_FIELDS if k not in data]
    if missing:
        raise ValueError(f"hardware description lacks {', '.join(missing)}")
    values: dict[str, float] = {}
    notes: dict[str, str] = {}
    for key in HARDWARE_FIELDS:
        values[key], notes[key] = _hardware_value(data, key)
        if values[key] < 0 or (values[key] == 0 and key not in MAY_BE_ZERO):
            raise ValueError(f"hardware field {key!r} must be positive")
    for key in OPTIONAL_HARDWARE_FIELDS:
        if key in data:
            values[key], notes[key] = _hardware_value(data, key)
            if values[key] < 0:
                raise ValueError(f"hardware field {key!r} must not be negative")
    for key in ("gemm_max_efficiency", "attention_efficiency", "elementwise_efficiency"):
        if values[key] > 1:
            raise ValueError(f"{key} is a fraction of peak and must not exceed 1")
    measured = data.get("measured", {})
    description = str(data.get("description", ""))
    return Hardware(
        name=str(data.get("name", "custom")),
        description=description,
        notes=notes,
        measured={str(k): str(v) for k, v in measured.items()} if isinstance(measured, dict) else {},
        peak_dtype=_peak_dtype(data.get("peak_dtype"), notes["peak_flops"], description),
        **values,
    )


def _peak_dtype(given: object, note: str, description: str) -> str:
    """The format of peak_flops: ``given`` (the file's ``peak_dtype``), else the only one of
    :data:`PEAK_DTYPES` that the peak's note names, else the only one the description names, else ""."""
    if given is not None:
        if str(given).lower() not in PEAK_DTYPES:
            raise ValueError(f"hardware field 'peak_dtype' is {given!r}; give one of {', '.join(PEAK_DTYPES)}")
        return str(given).lower()
    for text in (note, description):
        named = {word.lower() for word in _DTYPE_WORD.findall(text)}
        if len(named) == 1:
            return named.pop()
    return ""


def peak_flops_for(hw: Hardware, dtype: str) -> float | None:
    """``hw``'s peak FLOP/s of one device computing in ``dtype`` (``fp32``, ``bf16``, ...); None when
    the file gives the peak of another format or does not say which (never a converted guess)."""
    return hw.peak_flops if hw.peak_dtype and hw.peak_dtype == dtype.lower() else None


def load_hardware(name_or_path: str = DEFAULT_HARDWARE) -> Hardware:
    """A bundled hardware file by name (``a100-80gb-nvlink``, ``h100``, ``h200``) or any JSON file by path."""
    if (
        os.path.sep in name_or_path
        or name_or_path.endswith(".json")
        or os.path.isfile(name_or_path)
    ):
        with open(name_or_path) as f:
            return hardware_from_dict(json.load(f))
    resource = importlib.resources.files("boost_compile").joinpath(
        "hardware", f"{name_or_path}.json"
    )
    if not resource.is_file():
        raise ValueError(
            f"unknown hardware {name_or_path!r}; bundled: {', '.join(HARDWARE_FILES)}; or a JSON path"
        )
    return hardware_from_dict(json.loads(resource.read_text()))
