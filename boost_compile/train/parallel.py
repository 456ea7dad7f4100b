"""Processes, the device mesh, and the model as each rank runs it.

``torchrun`` starts ``pp * dp * tp`` processes; :func:`setup_distributed` joins
them and :func:`build_mesh` lays them out as the DeviceMesh ``(dp, tp)``, or
``(pp, dp, tp)`` with pipeline parallelism (the one place the mesh's shape is
decided): a TP group is consecutive ranks, then dp, pp outermost.
:func:`build_model_parts` is the whole sequence from config to a trainable model: build (and factorize), shard over
``tp`` with ``boost_compile.parallelize_``, cast, compile, and wrap in DDP over
``dp`` (README: why DDP).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from boost_compile import _torch_compat as compat
from boost_compile.backend import Recorder, compile_graph
from boost_compile.blocks import BlockCompileError, compile_blocks, tensor_parallel
from boost_compile.config import BoostConfig, ConfigError
from boost_compile.train.config import TrainConfig
from boost_compile.train.model import build_model, build_on_meta, defers_init, materialize_part
from boost_compile.train.validate import ModelShape, env_world_size

if TYPE_CHECKING:
    from boost_compile.weight_sources import WeightSource

log = logging.getLogger("boost_compile.train")

MESH_DIMS = ("dp", "tp")
MESH_DIMS_PP = ("pp", "dp", "tp")  # with parallel.pp > 1
MESH_DIMS_FSDP = ("dp_replicate", "dp_shard", "tp")  # with parallel.dp_shard > 1 ("dp": the first two flattened)


# ----------------------------------------------------------------------------- processes


@dataclass
class Dist:
    """This process's place in the ``(dp, tp)`` mesh, or ``(pp, dp, tp)`` when ``pp > 1``.

    ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``. With FSDP2 (``parallel.dp_shard > 1``)
    ``dp`` counts every data-parallel rank (replicas x shards; the mesh's ``dp`` dim is the two
    flattened) and ``dp_shard`` those a weight is sharded over.
    """

    world: int
    rank: int
    dp: int
    tp: int
    device: torch.device
    mesh: Any = None  # DeviceMesh when world > 1
    pp: int = 1
    dp_shard: int = 1
    #: FSDP2: the mesh's dp_replicate and dp_shard dims flattened (every data-parallel rank)
    dp_mesh: Any = None
    #: expert parallelism: the experts sharded over groups of ``ep`` consecutive dp ranks (``parallel.ep``,
    #: dividing dp); the ``dp / ep`` groups hold the same experts, as replicas
    ep: int = 1
    #: with ``1 < ep < dp``: the mesh ``("edp", "ep", "tp")`` of the dp ranks cut into expert groups
    ep_mesh: Any = None
    #: with FSDP2 and expert replicas: the same ranks as ``("ep", "edp")``, whose ``Shard(0), Shard(0)``
    #: describes experts cut by ep, then by FSDP2 over their replicas (checkpoints)
    ep_edp_mesh: Any = None

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> Any:
        """The process group of this rank along ``dim``: a mesh dim, or ``"ep"`` (the ranks its experts
        are sharded over) and ``"edp"`` (the ranks that hold the same experts)."""
        if dim in ("ep", "edp"):
            if self.ep_mesh is not None:
                return self.ep_mesh[dim].get_group()
            if dim == "edp":
                raise ValueError("no expert replicas: parallel.ep equals parallel.dp")
            dim = "dp"
        if dim == "dp" and self.dp_mesh is not None:
            return self.dp_mesh.get_group()
        return None if self.mesh is None else self.mesh[dim].get_group()

    @property
    def experts_fsdp_mesh(self) -> Any:
        """FSDP2 (``dp_shard > 1``) with expert replicas: the replicas' ranks, which FSDP2 shards the
        experts over; else None (FSDP2 leaves the experts out)."""
        return self.ep_mesh["edp"] if self.ep_mesh is not None and self.dp_shard > 1 else None

    @property
    def experts_mesh(self) -> Any:
        """The mesh a checkpoint's expert tensors are DTensors over: ``dp`` (``Shard(0)``), or with
        replicas ``("edp", "ep")`` (``Replicate(), Shard(0)``)."""
        if self.ep_mesh is not None:
            return self.ep_mesh["edp", "ep"]
        return self.dp_mesh if self.dp_mesh is not None else self.mesh["dp"]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group("dp"))
        return value / self.dp

    def sum_over_pp(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over the pipeline ranks: a value only one stage holds (zeros elsewhere), on every stage."""
        if self.pp == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group("pp"))
        return value

    def barrier(self) -> None:
        """Every rank waits for all the others."""
        if self.world > 1:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on one of them."""
        if self.world == 1:
            return flag
        box = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())


def build_mesh(device: torch.device, dp: int, tp: int, pp: int = 1, dp_shard: int = 1) -> Any:
    """The DeviceMesh over every process: ``dp`` replicas of ``tp`` consecutive ranks,
    and with ``pp > 1`` ``pp`` such blocks of ``dp * tp`` ranks (dims ``("pp", "dp", "tp")``).
    With ``dp_shard > 1`` (FSDP2) the dims are ``("dp_replicate", "dp_shard", "tp")``, after ``"pp"``
    with pipeline stages (``Dist`` keeps ``dp_replicate`` and ``dp_shard`` flattened as its ``dp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp_shard > 1:
        if pp > 1:
            return init_device_mesh(device.type, (pp, dp, dp_shard, tp), mesh_dim_names=("pp", *MESH_DIMS_FSDP))
        return init_device_mesh(device.type, (dp, dp_shard, tp), mesh_dim_names=MESH_DIMS_FSDP)
    if pp == 1:
        return init_device_mesh(device.type, (dp, tp), mesh_dim_names=MESH_DIMS)
    return init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS_PP)


def setup_distributed(tc: TrainConfig) -> Dist:
    """Join the process group torchrun set up (if any) and build the (dp, tp) or (pp, dp, tp) mesh."""
    par = tc.parallel
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want = tc.trainer.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    mesh = None
    if world > 1:
        if not dist.is_initialized():
            backend = par.dist_backend if par.dist_backend != "auto" else ("nccl" if use_cuda else "gloo")
            timeout = datetime.timedelta(seconds=par.timeout_s)  # the mesh's groups inherit it
            dist.init_process_group(backend, device_id=device if use_cuda else None, timeout=timeout,
                                    **_attempt_store(rank, world, timeout))
        mesh = build_mesh(device, par.dp, par.tp, par.pp, par.dp_shard)
    dp_mesh = compat.flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp") if mesh is not None and par.dp_shard > 1 else None
    ep_mesh = ep_edp_mesh = None
    if mesh is not None and 1 < par.ep < par.data_ranks:  # data rank = edp * ep + its place in the expert group
        from torch.distributed.device_mesh import init_device_mesh

        dims = (par.data_ranks // par.ep, par.ep, par.tp)
        names = ("edp", "ep", "tp")
        if par.pp > 1:
            dims, names = (par.pp, *dims), ("pp", *names)
        ep_mesh = init_device_mesh(device.type, dims, mesh_dim_names=names)
        if par.dp_shard > 1:  # the same ranks, ep before edp (every rank builds it: a collective)
            from torch.distributed.device_mesh import DeviceMesh

            at = names.index("edp")
            order = list(range(len(names)))
            order[at], order[at + 1] = at + 1, at
            ep_edp_mesh = DeviceMesh(device.type, ep_mesh.mesh.permute(order),
                                     mesh_dim_names=tuple(names[i] for i in order))
    return Dist(world=world, rank=rank, dp=par.data_ranks, tp=par.tp, device=device, mesh=mesh, pp=par.pp,
                dp_shard=par.dp_shard, dp_mesh=dp_mesh, ep=par.ep, ep_mesh=ep_mesh, ep_edp_mesh=ep_edp_mesh)


def attempt() -> int:
    """Which start of the same run this is: 0 the first, 1 after one restart, ..."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dict[str, Any]:
    """After a restart, the process group's store keys under this attempt's prefix.

    torchrun's static rendezvous (``--master-addr/--master-port``, its default)
    keeps one TCPStore for every attempt: the restarted ranks would read the
    addresses the dead ones published there and fail to connect ("Connection
    refused"). The first attempt keeps torch's own ``env://`` set-up.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # the agent hosts the store
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"boost_compile/attempt_{restart}", store), "rank": rank, "world_size": world}


# ----------------------------------------------------------------------------- parameters


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def global_numel(p: torch.Tensor, dev: Dist) -> int:
    """Elements of the whole parameter, whether or not this rank holds only a TP shard."""
    experts = getattr(p, "_boost_ep", None)
    if experts is not None:  # this rank's experts of the layer's
        return p.numel() // experts.local * experts.total
    spec = getattr(p, "_boost_tp", None)
    if spec is not None and spec.dim is not None:  # a TP shard (under FSDP2 a DTensor whose whole is the shard)
        if spec.size is not None:  # a padded vocabulary: count the real rows only
            return p.numel() // p.shape[spec.dim] * spec.size
        return p.numel() * dev.tp
    return p.numel()


# ----------------------------------------------------------------------------- the model, parallel


def parallelize(model: nn.Module, tc: TrainConfig, dev: Dist, example: torch.Tensor) -> None:
    """Shard ``model`` over the tp dimension with ``boost_compile.parallelize_``."""
    import boost_compile

    if not hasattr(boost_compile, "parallelize_"):  # validate() said so already; belt and braces
        raise ConfigError("tensor parallelism is not available in this build (no boost_compile.parallelize_)")
    report = boost_compile.parallelize_(model, (example,), dev.mesh["tp"], plan=tc.parallel.plan)
    log.info("%s", report)


def shard_experts(model: nn.Module, dev: Dist, what: str = "") -> None:
    """``parallel.ep``: the model's experts sharded by expert over each group of ``ep`` dp ranks
    (``boost_compile.expert_parallel_``); a model without experts modules of a known form is
    refused in one line naming it. ``what``: a pipeline stage, which may hold no experts (logged)."""
    from boost_compile.distributed.expert_parallel import ExpertParallelError, expert_parallel_, find_experts

    if what and not find_experts(model):
        log.info("parallel.ep=%d: %s holds no experts", dev.ep, what)
        return
    try:
        report = expert_parallel_(model, dev.group("ep"))
    except ExpertParallelError as exc:
        raise ConfigError(f"parallel.ep={dev.ep}: {exc}") from exc
    log.info("parallel.ep=%d: %s%d experts layers sharded by expert, %d experts a layer on this rank (%s of %s expert "
             "parameters)", dev.ep, f"{what}: " if what else "", len(report.layers), report.experts_per_rank, f"{report.local_numel:,}",
             f"{report.total_numel:,}")


def compile_model(model: nn.Module, tc: TrainConfig, *, dynamic: bool | None = None,
                  recorder: Recorder | None = None) -> nn.Module:
    """``torch.compile`` with ``passes.backend`` (``none``: the model itself).

    ``dynamic=False`` for pipeline stages: the stages of one rank share their
    class's ``forward``, and Dynamo would make the second stage's shapes
    symbolic (automatic dynamic shapes on a recompile of the same code).
    ``recorder`` (``trainer.memory_report``): the boost backend records each graph
    it compiles there (the partitioned graphs' saved tensors, the calls of each), the compile
    caches off.
    """
    passes = tc.passes
    if passes.backend == "none":
        return model
    if compiles_per_block(tc, model):
        backend, options = _backend(tc, recorder, block_graph=True)
        try:
            compile_blocks(model, options, backend=backend, fullgraph=passes.fullgraph, dynamic=dynamic)
            return model
        except BlockCompileError as exc:
            if not tensor_parallel(model):
                raise
            log.info("passes.unit=block: compiling the whole model instead (%s)", exc)
    backend, options = _backend(tc, recorder)
    kwargs = {"options": options} if options is not None else {}
    return torch.compile(model, backend=backend, fullgraph=passes.fullgraph, dynamic=dynamic, **kwargs)


def _backend(tc: TrainConfig, recorder: Recorder | None, block_graph: bool = False) -> tuple[Any, dict[str, Any] | None]:
    """``passes.backend`` and its options; with a ``recorder``, the boost backend recording into it
    (its config telling it a graph is one block, ``block_graph``, as compile_blocks would)."""
    passes = tc.passes
    if passes.backend != "boost":
        return passes.backend, None
    if recorder is None:
        return passes.backend, dict(passes.options)
    from boost_compile.train.memory_report import recording_backend

    config = BoostConfig.from_options(dict(passes.options)).replace(block_graph=block_graph)
    return recording_backend(functools.partial(compile_graph, config=config, recorder=recorder), recorder), None


def compiles_per_block(tc: TrainConfig, model: nn.Module) -> bool:
    """``passes.unit=block``, unless ``trainer.memory_report`` is on without FSDP2 (it compiles the whole
    model, logged; FSDP2 shards the blocks compiled one by one, so there the report counts each graph's
    calls instead). A tensor-parallel model whose code around the blocks cannot run eagerly on its shards
    is compiled whole by :func:`compile_model` (logged with the construct)."""
    if tc.passes.unit != "block" or tc.passes.backend == "none":
        return False
    if tc.trainer.memory_report and tc.parallel.dp_shard > 1:
        log.info("passes.unit=block: trainer.memory_report keeps the blocks compiled one by one under FSDP2 "
                 "(parallel.dp_shard > 1 shards them): its saved activations are read per graph, times its calls")
    elif tc.trainer.memory_report:
        log.info("passes.unit=block: trainer.memory_report compiles the whole model (its saved-tensor "
                 "terms are read per compiled graph, and identical blocks would share one)")
        return False
    return True


def wrap_data_parallel(module: nn.Module, model: nn.Module, dev: Dist, bucket_mb: float = 25.0) -> nn.Module:
    """DDP over the dp dimension around the compiled module, gradients averaged in buckets of
    ``bucket_mb`` MiB (``parallel.bucket_mb``)."""
    if dev.dp == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    if any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
    from boost_compile.distributed.expert_parallel import is_expert_parameter

    ignored = [name for name, p in module.named_parameters() if is_expert_parameter(p)]
    if ignored:  # each rank's own experts: their gradients are already the mean (expert_parallel.py)
        DDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    return DDP(
        module,
        process_group=dev.group("dp"),
        broadcast_buffers=False,
        device_ids=[dev.device.index] if dev.device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
    )


def ddp_compile_settings(tc: TrainConfig, dp: int, per_block: bool = False) -> dict[str, Any]:
    """Dynamo settings the training step compiles under: no graph cut at DDP's gradient buckets
    when compiled per block, or whole with a checkpoint mode.

    Dynamo cuts a DDP module's graph at its gradient buckets (``optimize_ddp``) so that
    each bucket's all-reduce can start early. A cut through a block hides the block's
    structure from the checkpoint pass: that block is left to the partitioner and saves
    several times what ``lowrank`` or ``full`` keep. Compiled per block, every block's backward
    is an autograd node of its own, so DDP's hooks all-reduce its gradients as soon as it ends:
    the overlap comes without a cut. Compiled whole with a checkpoint mode, the step is one
    graph and the buckets are all-reduced after the backward.
    """
    if dp == 1:
        return {}
    if per_block:
        return {"optimize_ddp": False}
    checkpoint = tc.passes.options.get("checkpoint", "none") if tc.passes.backend == "boost" else "none"
    return {"optimize_ddp": False} if checkpoint in ("lowrank", "full") else {}


@dataclass
class ModelParts:
    """The model three ways: its parameters, what a training step calls, what evaluation calls."""

    model: nn.Module  # the parameters: the optimizer, checkpoints and gradient clipping use these
    train_fn: nn.Module  # compiled, in DDP when dp > 1
    eval_fn: nn.Module  # compiled with tp (a TP model runs only through the backend), else eager
    #: Dynamo settings around the calls of ``train_fn`` (:func:`ddp_compile_settings`)
    compile_settings: dict[str, Any] = field(default_factory=dict)


#: the weights' dtype of each precision that casts them (fp32 and bf16-mixed keep fp32 weights)
WEIGHT_DTYPES = {"bf16-true": torch.bfloat16, "fp64": torch.float64}


def cast_weights(model: nn.Module, precision: str) -> None:
    """Cast ``model`` to the weight dtype of ``precision`` (trainer.precision), if it has one."""
    if precision in WEIGHT_DTYPES:
        model.to(WEIGHT_DTYPES[precision])


def build_model_parts(
    tc: TrainConfig,
    shape: ModelShape,
    dev: Dist,
    example: torch.Tensor | None = None,
    *,
    before_compile: Callable[[nn.Module], None] | None = None,
    recorder: Recorder | None = None,
) -> ModelParts:
    """Build the model, shard it over tp, cast it, compile it and wrap it for dp.

    ``example``: a batch of this rank's inputs (on ``dev.device``), which
    ``parallelize_`` traces; needed when ``dev.tp > 1``. ``before_compile`` is
    called with the model once its parameters are final (sharded, cast) and
    before compilation and DDP: the optimizer and a resumed checkpoint bind
    the parameters there, as DDP's DTensor transform replaces them. Under FSDP2
    (``parallel.dp_shard > 1``) it is called after the blocks are compiled and
    sharded: the parameters are then DTensors, each rank's shard.
    ``recorder``: see :func:`compile_model`.
    """
    source = None
    if (dev.dp_shard > 1 or dev.tp > 1 or dev.ep > 1) and defers_init(tc):
        # on meta: each rank materialises its TP shards, or once sharded its FSDP2 shards of them
        model, source = build_on_meta(tc, shape, dev.device)
    else:
        model = build_model(tc, shape, dev.device)
    if dev.tp > 1:
        if example is None:
            raise ValueError("build_model_parts: tensor parallelism needs an example batch to trace")
        parallelize(model, tc, dev, example)  # before the experts are cut: it captures the model whole
        if source is not None and dev.dp_shard == 1 and dev.ep == 1:
            materialize_part(model, source, dev.device, "its TP shards")
            source = None
    if dev.ep > 1:
        shard_experts(model, dev)
        if source is not None and dev.dp_shard == 1:  # under FSDP2: its experts beside its shards, once sharded
            materialize_part(model, source, dev.device, "its experts, TP shards and replicated weights")
            source = None
    cast_weights(model, tc.trainer.precision)
    if dev.dp_shard > 1:  # FSDP2: the parameters are final once sharded, after the blocks are compiled
        return _fsdp_model_parts(model, tc, dev, before_compile, recorder, source)
    if before_compile is not None:
        before_compile(model)
    compiled = compile_model(model, tc, recorder=recorder)
    per_block = compiled is model and tc.passes.backend != "none"  # compiled in place, block by block
    train_fn = wrap_data_parallel(compiled, model, dev, tc.parallel.bucket_mb)
    # a TP model runs only through the backend; compiled per block, the model is its own compiled form
    eval_fn = compiled if dev.tp > 1 or per_block else model
    return ModelParts(model=model, train_fn=train_fn, eval_fn=eval_fn,
                      compile_settings=ddp_compile_settings(tc, dev.dp, per_block))


def _fsdp_model_parts(model: nn.Module, tc: TrainConfig, dev: Dist, bind: Callable[[nn.Module], None] | None,
                      recorder: Recorder | None, source: WeightSource | None = None) -> ModelParts:
    """torchtitan's order: the blocks compiled one by one, then ``fully_shard`` per block and the
    root (train/fsdp.py); a model built on meta (``source``) then materialises this rank's shards;
    the optimizer and a resumed checkpoint bind the sharded parameters."""
    from boost_compile.train.fsdp import shard_model

    compiled = compile_model(model, tc, recorder=recorder)
    shard_model(compiled, fsdp_mesh(dev), tc.trainer.precision, tc.parallel.reshards_after_forward,
                dev.experts_fsdp_mesh)
    if source is not None:
        materialize_part(model, source, dev.device, "its FSDP2 shards")
    if bind is not None:
        bind(model)
    return ModelParts(model=model, train_fn=compiled, eval_fn=compiled)


def fsdp_mesh(dev: Dist) -> Any:
    """The mesh FSDP2 shards over: ``dp_shard`` (1-D), or ``(dp_replicate, dp_shard)`` for HSDP."""
    return dev.mesh["dp_shard"] if dev.dp == dev.dp_shard else dev.mesh["dp_replicate", "dp_shard"]
