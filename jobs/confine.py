"""What an engine run may see on a worker: its environment, its files, other processes.

A run executes code the web app did not write: reward functions from the deployment's own
modules, and, where a deployment trusts a team's admins with it, their own ``module:function``
(``engine/rewards/policy.py``). That code must not reach what the worker and the web app hold:
database and broker credentials, the web app's secret key, the embedded database and broker
files, and the other runs' logs and checkpoints (other teams' work). Three layers, each cheap:

1. **Environment** (``engine_environment``): the engine gets an allow-list of variables (paths,
   locale, thread counts, CUDA/NCCL/vLLM/DeepSpeed/Triton/HF settings), never ``DATABASE_URL``,
   ``REDIS_URL``, ``SECRET_KEY`` nor anything whose name says token, secret, password or key.
   Its temporary files go to ``<workdir>/tmp``.
2. **Files** (Landlock, Linux >= 5.13, unprivileged, inherited by every child process): the run
   may read everything except the hidden paths (the data directory, the runs directory, the
   worker user's credential files) and write only its own working directory, ``/dev/shm``, the
   starter-policy cache and the compute caches (``ConfinementPlan``). Landlock rules only grant,
   so "everything but these" is granted as every sibling of every directory on the way down to
   a hidden path (``readable_roots``); the whole tree stays listable (names, not contents).
3. **Processes**: root's capabilities are dropped in the engine (``drop_capabilities``), and the
   processes that hold secrets in memory or in their environment (the Celery worker, the web
   app, ``manage.py serve``) make themselves non-dumpable (``make_undumpable``). Together with
   Landlock's own ptrace scoping, ``/proc/<pid>/environ`` and ``/proc/<pid>/mem`` of those
   processes are then out of reach even for a run started as root (checked in the tests).

``TRIBUTARY_CONFINE``: ``auto`` (default: confine where the kernel has Landlock, else run
unconfined with a warning in the run's log, and refuse a run allowed to name its own code),
``require`` (refuse any run that cannot be confined) or ``off``. ``TRIBUTARY_CONFINE_HIDDEN`` and
``TRIBUTARY_CONFINE_WRITABLE`` add paths (``:``-separated); ``TRIBUTARY_ENGINE_ENV`` adds
variable names the engine may see (comma-separated).

Not covered: the network (a run can open TCP connections: DeepSpeed's ranks rendezvous on a port
chosen at start), and the shared compute caches are writable by every run on the worker.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONFINE_ENV = "TRIBUTARY_CONFINE"
HIDDEN_ENV = "TRIBUTARY_CONFINE_HIDDEN"
WRITABLE_ENV = "TRIBUTARY_CONFINE_WRITABLE"
ENGINE_ENV_ENV = "TRIBUTARY_ENGINE_ENV"
MODES = ("auto", "require", "off")

# Variables the engine may see: by name, or by prefix. Anything that looks like a credential is
# dropped whatever its prefix (HF_TOKEN, NCCL_..._KEY).
PASS_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM",
        "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
        "LD_LIBRARY_PATH", "TOKENIZERS_PARALLELISM", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    }
)  # fmt: skip
PASS_PREFIXES = (
    "LC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "VLLM_",
    "DS_", "DEEPSPEED_", "TRITON_", "HF_", "TRANSFORMERS_", "KMP_", "MKL_", "OMP_",
)  # fmt: skip
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|(^|_)KEY($|_)|AUTH", re.IGNORECASE)

# The worker user's credential files, hidden whether or not the deployment thought of them.
HOME_SECRETS = (".ssh", ".aws", ".netrc", ".pgpass", ".docker", ".kube", ".git-credentials", ".config/gcloud")
# Compute caches the engine's libraries write (shared by the runs of a worker, so a second run
# does not rebuild DeepSpeed's ops or Triton's kernels); the env variable wins where it is set.
CACHES = (
    ("TORCH_EXTENSIONS_DIR", ".cache/torch_extensions"),
    ("TRITON_CACHE_DIR", ".triton"),
    ("VLLM_CACHE_ROOT", ".cache/vllm"),
    ("HF_HOME", ".cache/huggingface"),
    ("", ".cache/torch"),
)
DEVICES = ("/dev/null", "/dev/shm", "/dev/dri", "/dev/infiniband", "/dev/kfd")  # plus /dev/nvidia*


class ConfinementUnavailable(RuntimeError):
    """The run must be confined and this kernel cannot do it."""


def confine_mode(environ: Mapping[str, str] = os.environ) -> str:
    mode = environ.get(CONFINE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{CONFINE_ENV}={mode!r}: use one of {', '.join(MODES)}")
    return mode


def _paths(raw: str) -> list[Path]:
    return [Path(p).expanduser() for p in raw.split(":") if p.strip()]


def engine_environment(
    environ: Mapping[str, str], workdir: Path, *, extra_names: Iterable[str] = (), **fixed: str
) -> dict[str, str]:
    """The engine's environment: the allow-listed part of ``environ``, plus ``fixed``.

    ``TMPDIR`` points into the run's own directory (``<workdir>/tmp``, created here) so that
    nothing the run writes lands in a directory it shares with others."""
    allowed = set(PASS_NAMES) | {n.strip() for n in environ.get(ENGINE_ENV_ENV, "").split(",") if n.strip()}
    allowed |= set(extra_names)
    env = {
        name: value
        for name, value in environ.items()
        if (name in allowed or name.startswith(PASS_PREFIXES)) and not SECRET_NAME.search(name)
    }
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env.update(fixed)
    return env


@dataclass
class ConfinementPlan:
    """What one run may touch; JSON-serialisable, handed to the launcher (``jobs/launcher.py``)."""

    workdir: str
    hidden: list[str] = field(default_factory=list)
    writable: list[str] = field(default_factory=list)
    readable: list[str] = field(default_factory=list)  # granted even inside a hidden path
    required: bool = False  # refuse to run unconfined

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> ConfinementPlan:
        return cls(**json.loads(raw))

    @classmethod
    def for_run(
        cls,
        workdir: Path,
        *,
        data_dir: Path,
        runs_dir: Path,
        readable: Iterable[Path] = (),
        required: bool = False,
        environ: Mapping[str, str] = os.environ,
    ) -> ConfinementPlan:
        """The plan for a run in ``workdir``: hide the data and runs directories and the worker
        user's credentials; write the run's own directory, the starter cache and the caches."""
        home = Path(environ.get("HOME") or Path.home())
        hidden = [data_dir, runs_dir, *(home / name for name in HOME_SECRETS), *_paths(environ.get(HIDDEN_ENV, ""))]
        starter = data_dir / "starter"
        caches = [Path(environ[var]) if environ.get(var) else home / default for var, default in CACHES]
        writable = [workdir, starter, *caches, *_paths(environ.get(WRITABLE_ENV, ""))]
        for path in writable:
            path.mkdir(parents=True, exist_ok=True)
        return cls(
            workdir=str(workdir),
            hidden=[str(p) for p in hidden],
            writable=[str(p) for p in writable],
            readable=[str(p) for p in readable],
            required=required,
        )


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or this is not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    import landlockpy

    return landlockpy.abi_version() if landlockpy.supported() else 0


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def readable_roots(hidden: Iterable[Path]) -> list[Path]:
    """Paths whose hierarchies together cover the whole tree but the ``hidden`` ones.

    For every directory on the way from ``/`` down to a hidden path, each entry that is neither
    hidden nor itself on such a way is a root. A symbolic link whose target lies on such a way
    or inside a hidden path is left out (granting it would grant its target)."""
    hide = {_real(h) for h in hidden if os.path.lexists(h)}
    ways = {parent for h in hide for parent in h.parents}
    roots: list[Path] = []
    for directory in sorted(ways):
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            if path in hide or path in ways:
                continue
            target = _real(path)
            if target in ways or any(target == h or h in target.parents for h in hide):
                continue
            roots.append(path)
    return roots


def _devices() -> list[Path]:
    found = [Path(p) for p in DEVICES if os.path.exists(p)]
    if os.path.isdir("/dev"):
        found += sorted(p for p in Path("/dev").glob("nvidia*"))
    return found


def apply_landlock(plan: ConfinementPlan) -> None:
    """Restrict this thread and every process it starts afterwards to ``plan`` (irreversible)."""
    from landlockpy import AccessFS, Ruleset, Scope

    read = AccessFS.EXECUTE | AccessFS.READ_FILE | AccessFS.READ_DIR
    write = (
        read | AccessFS.WRITE_FILE | AccessFS.TRUNCATE | AccessFS.REMOVE_DIR | AccessFS.REMOVE_FILE
        | AccessFS.MAKE_DIR | AccessFS.MAKE_REG | AccessFS.MAKE_SOCK | AccessFS.MAKE_FIFO
        | AccessFS.MAKE_SYM | AccessFS.REFER
    )  # fmt: skip
    handled = write | AccessFS.MAKE_CHAR | AccessFS.MAKE_BLOCK  # device ioctls stay unrestricted (GPUs)
    with Ruleset(handled_fs=handled, handled_net=0, scoped=Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL) as rules:
        rules.allow_path("/", AccessFS.READ_DIR)
        for root in readable_roots([Path(p) for p in plan.hidden]):
            try:
                rules.allow_path(root, read)
            except OSError:  # gone since it was listed, or a dangling link
                continue
        for path in [Path(p) for p in plan.readable]:
            if path.exists():
                rules.allow_path(path, read)
        for path in [*map(Path, plan.writable), *_devices()]:
            if path.exists():
                rules.allow_path(path, write if path.is_dir() else write & ~_dir_only(AccessFS))
        rules.restrict()


def _dir_only(access: type) -> int:
    """Rights the kernel refuses in a rule on a file (they only make sense on a directory)."""
    return (
        access.READ_DIR | access.REMOVE_DIR | access.REMOVE_FILE | access.MAKE_DIR | access.MAKE_REG
        | access.MAKE_SOCK | access.MAKE_FIFO | access.MAKE_SYM | access.REFER
    )  # fmt: skip


_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_CAPSET = {"x86_64": 126, "aarch64": 91}
_CAP_VERSION_3 = 0x20080522


def make_undumpable() -> None:
    """Keep this process's memory and environment (``/proc/<pid>/mem``, ``environ``) from
    processes without CAP_SYS_PTRACE, even of the same user. Called by the processes that hold
    secrets: the Celery worker, the web app, ``manage.py serve``."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def drop_capabilities() -> None:
    """Drop every capability of this process (and so of what it executes): root keeps its uid
    but loses CAP_DAC_OVERRIDE, CAP_SYS_PTRACE and the rest. No-op for an unprivileged user."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    cap = 0
    while libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    number = _CAPSET.get(os.uname().machine)
    if number is None:
        raise ConfinementUnavailable(f"dropping capabilities is not implemented on {os.uname().machine}")
    header, data = Header(_CAP_VERSION_3, 0), (Data * 2)()
    if libc.syscall(number, ctypes.byref(header), ctypes.byref(data)) != 0:
        err = ctypes.get_errno()
        raise ConfinementUnavailable(f"capset failed: {os.strerror(err)}")


def confine(plan: ConfinementPlan) -> str:
    """Apply ``plan`` to this process: Landlock, then no capabilities. Returns what was done, or
    raises ``ConfinementUnavailable`` when the plan is required and the kernel cannot."""
    abi = landlock_abi()
    if abi == 0:
        if plan.required:
            raise ConfinementUnavailable(
                "this run must be confined (it may run its own reward code, or TRIBUTARY_CONFINE=require) "
                "but the kernel has no Landlock (Linux >= 5.13 with landlock in its LSM list)"
            )
        drop_capabilities()
        return "not confined: the kernel has no Landlock; environment scrubbed only"
    apply_landlock(plan)
    drop_capabilities()
    return f"confined (Landlock ABI {abi}): reads all but {len(plan.hidden)} hidden paths, writes its own directory"
