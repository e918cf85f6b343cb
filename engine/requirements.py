"""What a run needs from the machine that runs it (GPUs, installed backends), read from its ``RunConfig``.

The one place that knows which config fields imply hardware or packages: the web app routes a queued
run to a worker that has them and the worker checks them again before it starts the engine (both
through ``jobs.capabilities``). Stdlib and the config only, so neither has to import torch for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import RunConfig


@dataclass(frozen=True)
class Requirements:
    """What a run needs from the machine that runs it.

    ``gpus``: GPUs it cannot run without (``trainer.device: cuda``). ``gpus_used``: GPUs it takes on a
    worker that lends it GPUs (``auto`` takes them as ``cuda`` does; ``cpu`` takes none). ``backends``:
    the packages (``jobs.capabilities.BACKEND_DISTRIBUTIONS`` names) that must be installed.
    """

    gpus: int = 0
    backends: frozenset[str] = frozenset({"torch"})
    gpus_used: int = 0

    def describe(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"] if self.gpus else ["no GPU"]
        extra = sorted(self.backends - {"torch"})
        if extra:
            parts.append("backends " + ", ".join(extra))
        return " and ".join(parts)


def run_requirements(cfg: RunConfig) -> Requirements:
    """The machine ``cfg`` needs.

    GPUs: one per trainer rank (``trainer.num_ranks``, DeepSpeed's data-parallel ranks; 1 otherwise), or
    as many as ``rollout.device: cuda:N`` reaches (it generates on the (N+1)-th GPU the run is lent).
    ``trainer.device: cuda`` needs them; ``auto`` runs anywhere (on the GPUs a worker lends it, else on its
    CPUs). Backends: ``rollout.backend``, ``trainer.backend`` and a ``triton`` log-prob kernel.
    """
    rollout, trainer = cfg.rollout, cfg.trainer
    backends = {"torch", rollout.backend, trainer.backend}
    if trainer.logprob_impl == "triton":
        backends.add("triton")
    rollout_gpus = int(rollout.device.split(":")[1]) + 1 if rollout.device.startswith("cuda:") else 0
    gpu_set = max(trainer.num_ranks, rollout_gpus)
    return Requirements(
        gpus=gpu_set if trainer.device == "cuda" else 0,
        backends=frozenset(backends),
        gpus_used=0 if trainer.device == "cpu" else gpu_set,
    )
