"""A rollout backend in a process of its own (``rollout.own_process``).

Why a second process:

- **A GPU of its own.** vLLM's engine takes the first GPU its process sees, and CUDA fixes a
  process's visible devices when it starts. An asynchronous run that generates on one GPU while it
  trains on another (AReaL, verl's fully-async mode) therefore needs the generator in a process whose
  ``CUDA_VISIBLE_DEVICES`` names the rollout GPU alone: ``rollout.device: cuda:1`` starts the child
  with the trainer's second visible GPU as its only one.
- **No shared interpreter.** The producer thread and the trainer contend for the GIL; vLLM also
  changes its process for good (``torch.set_num_threads`` becomes a no-op, global distributed state).
  In a child, neither touches the trainer.

How: the child is ``python -m engine.rollout.process_backend FD``, started with ``subprocess`` (not
``multiprocessing``: no re-import of the parent's ``__main__``, and the same launch habits as
``engine/ranks.py``): its own session, so the supervisor's SIGTERM to the engine's process group
reaches only the engine, which checkpoints and closes the backend; ``PR_SET_PDEATHSIG``, so it dies with
the engine even on SIGKILL; stdout sent to stderr, because the engine's stdout may be the event log.
Requests and replies are pickled over a socket pair (``multiprocessing.connection.Connection``); every
call is synchronous, and a call the child fails raises the same exception type here, with the child's
message, so callers see exactly what an in-process backend would raise.

Weights travel through shared memory, not the socket: the first ``update_weights`` lays every tensor
out in one file under ``/dev/shm`` (space reserved with ``posix_fallocate``, so a full ``/dev/shm``
fails here with a clear error instead of a SIGBUS later), both processes map it, and the file is
unlinked at once (the mappings stay; nothing is left behind if either process is killed). Each update
then copies the tensors into the mapping (one device-to-host copy from a GPU trainer) and the child loads
them into its backend (one host-to-device copy onto the rollout GPU), ~2x the model's bytes over PCIe:
about 1 s for 7B parameters in bf16 at 25 GB/s, paid by the producer thread, off the trainer's path.
"""

from __future__ import annotations

import builtins
import contextlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.ranks import die_with_parent
from engine.rollout.base import PromptCompletions, SamplingParams

__all__ = ["BackendSpec", "ProcessRolloutBackend", "RolloutProcessError", "SharedWeights"]

START_TIMEOUT_S = 900.0
"""How long the child may take to build its backend (vLLM with CUDA graphs on a big model is slow)."""
ALIGN = 64
RAISED_AS_IS = ("KeyError", "ValueError", "TypeError", "IndexError", "ImportError", "RuntimeError", "NotImplementedError")
"""Exceptions of the child re-raised here with the same type (the rest become ``RolloutProcessError``)."""


class RolloutProcessError(RuntimeError):
    """The rollout process failed, or died (its exit code and the end of its traceback are in the message)."""


@dataclass
class BackendSpec:
    """What the child needs to build the backend: everything is plain data (the run config as JSON)."""

    name: str  # "torch" | "vllm"
    model_dir: str
    dtype: str = "float32"  # the torch backend's model dtype
    device: str = "cpu"  # the child's own view: "cpu", or "cuda" (its cuda:0: the one GPU it was given)
    threads: int = 0  # torch intra-op threads in the child (0: torch's default)
    run_config: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of make_rollout_backend


# ----------------------------------------------------------------------------- shared weights


@dataclass(frozen=True)
class _Slot:
    name: str
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _size(slots: list[_Slot]) -> int:
    return max(1, slots[-1].offset + slots[-1].nbytes) if slots else 1


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedWeights:
    """Named tensors laid out in one memory-mapped file that two processes share.

    ``SharedWeights.create(state_dict)`` reserves the file and maps it; ``SharedWeights.attach(path,
    slots)`` maps it in the other process; ``unlink()`` removes the name once both have mapped it.
    ``tensors`` are views of the mapping: writing one in either process is seen by the other.
    """

    def __init__(self, path: Path, slots: list[_Slot], fd: int) -> None:
        self.path, self.slots = path, slots
        try:
            self._map = mmap.mmap(fd, _size(slots))
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensors: dict[str, torch.Tensor] = {
            s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in slots
        }

    @staticmethod
    def layout(state_dict: Mapping[str, torch.Tensor]) -> list[_Slot]:
        slots, offset = [], 0
        for name, t in state_dict.items():
            nbytes = t.numel() * t.element_size()
            slots.append(_Slot(name, _dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return slots

    @classmethod
    def create(cls, state_dict: Mapping[str, torch.Tensor]) -> SharedWeights:
        slots = cls.layout(state_dict)
        size = _size(slots)
        directory = _shm_dir()
        path = directory / f"tributary-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
            raise RolloutProcessError(
                f"rollout.own_process: the weights need {size / 2**30:.2f} GiB of shared memory in {directory}, "
                f"which has {free / 2**30:.2f} GiB free ({exc.strerror}); give it more (in Docker: shm_size / "
                "--shm-size) or set rollout.own_process: false"
            ) from exc
        return cls(path, slots, fd)

    @classmethod
    def attach(cls, path: str, slots: list[_Slot]) -> SharedWeights:
        return cls(Path(path), slots, os.open(path, os.O_RDWR))

    def matches(self, state_dict: Mapping[str, torch.Tensor]) -> bool:
        return self.layout(state_dict) == self.slots

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def write(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in state_dict.items():
                self.tensors[name].copy_(tensor.detach())


# ----------------------------------------------------------------------------- the engine's side


def visible_device_env(device: str) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a child that generates on ``device`` of this process.

    ``cuda:N`` is this process's N-th visible GPU (the worker may have lent the run a subset, e.g.
    ``CUDA_VISIBLE_DEVICES=4,5``: ``cuda:1`` is GPU 5); the child sees that GPU alone. ``cpu`` hides
    every GPU; ``cuda`` (no index) keeps this process's view (the child's ``cuda:0`` is ours).
    """
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if not device.startswith("cuda:"):
        return {}
    index = int(device.split(":", 1)[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(index + 1)]
    if index >= len(ids):
        raise ValueError(
            f"rollout.device: {device!r} but this process sees {len(ids)} GPU(s) ({visible}); use a GPU it has"
        )
    return {"CUDA_VISIBLE_DEVICES": ids[index]}


class ProcessRolloutBackend:
    """A :class:`~engine.rollout.base.RolloutBackend` whose work happens in a child process.

    ``spec`` says which backend the child builds; ``env`` is added to the child's environment (its
    visible GPUs, thread counts). Calls are serialised (one request in flight); ``close`` stops the child.
    """

    def __init__(self, spec: BackendSpec, *, env: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._version = int(spec.options.get("policy_version", 0))
        self._weights: SharedWeights | None = None
        self._closed = False
        ours, theirs = socket.socketpair()
        child_env = {**os.environ, **(env or {})}
        if spec.threads:
            child_env["OMP_NUM_THREADS"] = str(spec.threads)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "engine.rollout.process_backend", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=child_env,
                stdout=2,  # our stderr: the engine's stdout may be the event log
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self.info: dict[str, Any] = self._call("start", spec, timeout=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(self.info["vocab_size"])

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def pid(self) -> int:
        return self._proc.pid

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[PromptCompletions]:
        return self._call("generate", [list(map(int, p)) for p in prompts], params)

    def continuation_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        temperature: float = 1.0,
        *,
        reduced_precision: bool = False,
    ) -> list[float]:
        return self._call(
            "continuation_logprobs",
            [list(map(int, p)) for p in prompts],
            [list(map(int, c)) for c in continuations],
            float(temperature),
            bool(reduced_precision),
        )

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the weights into the shared mapping, then have the child load them (checked there)."""
        with self._lock:
            if self._weights is None or not self._weights.matches(state_dict):
                self._attach(state_dict)
            assert self._weights is not None
            self._weights.write(state_dict)
            self._request("update_weights", list(state_dict), int(version))
            self._version = int(version)

    def _attach(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        shared = SharedWeights.create(state_dict)
        try:
            self._request("attach", str(shared.path), shared.slots)
        finally:
            shared.unlink()  # both processes have it mapped (or the child failed): the name is not needed
        self._weights = shared

    def close(self) -> None:
        """Stop the child (politely, then by force) and release the shared weights."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError, EOFError, RolloutProcessError):
            if self._proc.poll() is None:
                self._conn.send(("close", ()))
                self._conn.poll(30.0) and self._conn.recv()
        self._conn.close()
        try:
            self._proc.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._weights = None

    # -- the wire ---------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        with self._lock:
            return self._request(method, *args, timeout=timeout)

    def _request(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self._closed:
            raise RuntimeError("the rollout process backend is closed")
        try:
            self._conn.send((method, args))
            if timeout is not None and not self._conn.poll(timeout):
                self._proc.kill()
                raise RolloutProcessError(f"the rollout process did not answer {method!r} within {timeout:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._proc.wait()
            raise RolloutProcessError(
                f"the rollout process exited (code {code}) during {method!r}; its output is in the engine's "
                "stderr (the worker's log)"
            ) from exc
        status, value = reply
        if status == "ok":
            return value
        kind, exc_args, child_traceback = value
        if kind in RAISED_AS_IS:
            raise getattr(builtins, kind)(*exc_args) from RolloutProcessError(child_traceback)
        raise RolloutProcessError(f"{kind}: {exc_args[0] if exc_args else ''}\n{child_traceback}")


# ----------------------------------------------------------------------------- the child's side


class _Server:
    """Builds the backend and answers requests until ``close`` (or until the engine goes away)."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.weights: SharedWeights | None = None

    def start(self, spec: BackendSpec) -> dict[str, Any]:
        from engine.config import RunConfig
        from engine.models import load_model, load_tokenizer
        from engine.rollout import make_rollout_backend

        if spec.threads:
            torch.set_num_threads(spec.threads)
        tokenizer = load_tokenizer(spec.model_dir)
        model = None
        if spec.name == "torch":
            dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
            model = load_model(spec.model_dir, dtype=dtype, device=spec.device)
        run_config = RunConfig.model_validate(spec.run_config) if spec.run_config is not None else None
        self.backend = make_rollout_backend(
            spec.name, model, tokenizer, model_dir=spec.model_dir, run_config=run_config, **spec.options
        )
        return {"vocab_size": int(self.backend.vocab_size), "pid": os.getpid(), "device": spec.device}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[PromptCompletions]:
        return self.backend.generate(prompts, params)

    def continuation_logprobs(
        self, prompts: list[list[int]], continuations: list[list[int]], temperature: float, reduced_precision: bool
    ) -> list[float]:
        return self.backend.continuation_logprobs(
            prompts, continuations, temperature, reduced_precision=reduced_precision
        )

    def attach(self, path: str, slots: list[_Slot]) -> None:
        self.weights = SharedWeights.attach(path, slots)

    def update_weights(self, names: list[str], version: int) -> None:
        if self.weights is None:
            raise RuntimeError("update_weights before the shared weights were attached")
        self.backend.update_weights({n: self.weights.tensors[n] for n in names}, version)

    def serve(self, conn: Connection) -> None:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                break  # the engine closed its end
            if method == "close":
                self._close()
                conn.send(("ok", None))
                break
            try:
                conn.send(("ok", getattr(self, method)(*args)))
            except Exception as exc:
                conn.send(("error", (type(exc).__name__, _picklable_args(exc), traceback.format_exc()[-4000:])))
        self._close()

    def _close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def _picklable_args(exc: BaseException) -> tuple[Any, ...]:
    args = tuple(a if isinstance(a, (str, int, float)) else str(a) for a in exc.args)
    return args or (str(exc),)


def main(argv: Sequence[str]) -> int:
    # The engine decides when generation stops: the signals of its process group or terminal are its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    if os.getppid() == 1:  # the engine died before the death signal was armed
        return 1
    _Server().serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
