"""Jobs started by Hydra's plugins: the submitit launcher's processes and the optuna sweeper.

Under torchrun each process finds its rank, the world size and the rendezvous in
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. The
submitit launcher (``hydra/launcher=submitit_local`` or ``submitit_slurm``) starts
``tasks_per_node`` processes per node itself, each of which calls the Hydra task in
place: :func:`adopt_submitit_environment` turns submitit's job environment into
torchrun's variables, so everything after it (:func:`~boost_compile.train.parallel.setup_distributed`,
the run folder, checkpoints) works as under torchrun.

Both plugins are optional extras (``pip install 'boost-compile[sweep]'``):
:func:`check_plugins` refuses a command line that names one that is not installed,
before Hydra fails to load it deep inside its config loader.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence

from boost_compile.config import ConfigError

#: The Hydra plugins boost-train knows: the word that selects one on the command
#: line (in ``hydra/launcher=...``, ``hydra/sweeper=...`` or an ``experiment=`` name)
#: -> the package that provides it and the pip requirement that installs it.
PLUGINS = {
    "submitit": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "optuna": ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
}


def under_submitit() -> bool:
    """True in a process the submitit launcher started (local or SLURM): submitit sets ``SUBMITIT_EXECUTOR``."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def adopt_submitit_environment() -> int | None:
    """Under submitit, export torchrun's variables from the job environment; returns this process's rank.

    The rendezvous is the job's first host, on a port drawn from the job id (submitit's
    choice, so that the jobs of one sweep running side by side do not meet). ``LOCAL_RANK``
    picks the GPU (``cuda:LOCAL_RANK``), so ``CUDA_VISIBLE_DEVICES`` is left as it is.
    Outside submitit nothing changes and None is returned.
    """
    if not under_submitit():
        return None
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return int(env.rank)


def quiet_worker_logging(rank: int) -> None:
    """Ranks above 0 print warnings and errors only, on stderr (rank 0 writes the run's log).

    torchrun's workers get this from ``hydra/job_logging=boost_worker`` on their command
    line; submitit's tasks share one Hydra job config, so the task sets it itself.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


def plugins_named(argv: Sequence[str]) -> list[str]:
    """The plugins of :data:`PLUGINS` a command line selects (by a launcher, sweeper or experiment choice)."""
    named = []
    for word in PLUGINS:
        for arg in argv:
            key, _, value = arg.partition("=")
            if key.lstrip("+~") in ("hydra/launcher", "hydra/sweeper", "experiment") and word in value:
                named.append(word)
                break
    return named


def check_plugins(argv: Sequence[str]) -> None:
    """Refuse a command line that selects a plugin that is not installed, naming the extra that installs it."""
    for word in plugins_named(argv):
        package, requirement = PLUGINS[word]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{' '.join(a for a in argv if word in a)} needs the Hydra plugin {requirement}, which is not "
                f"installed; install it with pip install 'boost-compile[sweep]'"
            )
