"""Reward functions by name: the built-ins registered here, and users' own as ``module:function``.

Every reward function has one calling convention, so the manager treats built-ins and user code
alike::

    fn(completion: str, *, answer: str | None, prompt: str, metadata: dict, response_length: int,
       max_response_length: int, finish_reason: str, **params) -> float

Built-ins take ``**kwargs`` and ignore what they do not need. A user function may declare only
what it uses (``def f(completion, answer)``): it receives just the keyword arguments its
signature accepts, so adding an input field later never breaks existing user code. The
completion goes to a parameter named ``completion``, else to the first positional parameter
whatever its name. ``params`` are the
``reward.functions[i].params`` of the config, checked against the signature before a run starts
(a typo in a parameter name must fail at launch, not score 0 for hours).

User functions are named ``package.module:function`` rather than registered with a decorator:
the scoring workers are separate processes, and an import path is the one thing they can
resolve on their own. Which of them a run may name is a deployment's decision
(``engine/rewards/policy.py``): ``resolve_reward`` checks the policy before it imports anything.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.rewards.policy import RewardPolicy

INPUT_FIELDS: tuple[str, ...] = (
    "answer",
    "prompt",
    "metadata",
    "response_length",
    "max_response_length",
    "finish_reason",
)
"""Keyword inputs every reward function may receive, after the completion (in this order)."""

ItemTuple = tuple[str, "str | None", str, "dict[str, Any]", int, int, str]
"""``(completion, *INPUT_FIELDS)``: the compact form items travel in (cheap to pickle)."""

_USER_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class RewardParamError(ValueError):
    """A bad ``params`` entry; ``param`` is its key, so callers can point at the config field."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


@dataclass(frozen=True)
class RewardSpec:
    """A resolved reward function.

    ``ref`` is ``module:qualname``, importable in a fresh worker process. ``inline`` marks
    built-ins that are cheap and cannot hang, which the manager runs in the calling process
    instead of paying a process round trip. ``builtin`` functions accept only the parameters
    they declare; ``check`` validates parameter values before a run.
    """

    name: str
    fn: Callable[..., Any]
    ref: str
    inline: bool = False
    builtin: bool = False
    check: Callable[[dict[str, Any]], None] | None = None


_REGISTRY: dict[str, RewardSpec] = {}


def register_reward(
    name: str,
    *,
    inline: bool = False,
    check: Callable[[dict[str, Any]], None] | None = None,
    warmup: Callable[[], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a built-in reward function under ``name`` (the function is returned unchanged).

    ``inline=True`` only for functions that are fast and cannot hang: they bypass the process
    pool and its timeouts. ``warmup`` runs once in each worker process before it takes work, so
    that heavy imports do not count against the first call's timeout.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        existing = _REGISTRY.get(name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"reward function '{name}' is already registered ({existing.ref})")
        if warmup is not None:
            fn.reward_warmup = warmup  # type: ignore[attr-defined]
        _REGISTRY[name] = RewardSpec(
            name=name,
            fn=fn,
            ref=f"{fn.__module__}:{fn.__qualname__}",
            inline=inline,
            builtin=True,
            check=check,
        )
        return fn

    return decorate


def registered_rewards() -> list[str]:
    """Names of the registered reward functions, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(name: str, policy: RewardPolicy | None = None) -> Callable[..., Any]:
    """The reward function called ``name``: a registered name or ``package.module:function``."""
    return resolve_reward(name, policy).fn


def resolve_reward(name: str, policy: RewardPolicy | None = None) -> RewardSpec:
    """Look ``name`` up in the registry or import it; errors say what to write instead.

    ``policy`` (default: this process's, ``RewardPolicy.from_env()``) decides whether a
    ``module:function`` may be imported at all; it is checked before the import, so a refused
    module's top-level code never runs."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ValueError(
            f"unknown reward function '{name}'; {hint}registered: {', '.join(registered_rewards())}; "
            "or give your own as 'package.module:function'"
        )
    policy = policy or RewardPolicy.from_env()
    check_user_ref(name)
    policy.check_name(name)
    fn = import_object(name)
    policy.check_loaded(name, fn)
    if not callable(fn):
        raise ValueError(
            f"reward function '{name}' is a {type(fn).__name__}, not a function; point it at a "
            "function fn(completion, **kwargs) -> float"
        )
    return RewardSpec(name=name, fn=fn, ref=name)


def check_user_ref(ref: str) -> None:
    """Raise ValueError unless ``ref`` has the form ``package.module:function``."""
    if not _USER_REF.match(ref):
        raise ValueError(
            f"reward function '{ref}' is not of the form 'package.module:function' "
            "(dotted module path, one colon, function name)"
        )


def import_object(ref: str) -> Any:
    """Import ``package.module:attr.path``; errors name the module or attribute and the fix."""
    check_user_ref(ref)
    module_name, attr_path = ref.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"reward function '{ref}': cannot import module '{module_name}' ({exc}); install it or put "
            "its directory on PYTHONPATH"
        ) from None
    except Exception as exc:
        raise ValueError(
            f"reward function '{ref}': importing module '{module_name}' raised "
            f"{type(exc).__name__}: {exc}; fix the module so that it imports cleanly"
        ) from None
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            where = module_name if i == 0 else f"{module_name}:{'.'.join(attr_path.split('.')[:i])}"
            public = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = (
                f"; did you mean '{close[0]}'?" if close else f"; define {part}(completion, **kwargs) there"
            )
            raise ValueError(f"reward function '{ref}': '{where}' has no attribute '{part}'{hint}")
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- calling


@dataclass(frozen=True)
class _Signature:
    completion: str  # how the completion is passed: "keyword" (completion=), "positional" or "none"
    var_keyword: bool  # the function takes **kwargs
    inputs: tuple[str, ...]  # the INPUT_FIELDS it accepts
    settable: frozenset[str]  # parameter names a config may set
    required: frozenset[str]  # parameters without defaults the config must set


def _inspect(fn: Callable[..., Any]) -> _Signature:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature: pass everything
        return _Signature("positional", True, INPUT_FIELDS, frozenset(), frozenset())
    params = list(sig.parameters.values())
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
    named = sig.parameters.get("completion")
    taken: set[str] = set()
    if named is not None and named.kind in by_keyword:
        completion = "keyword"
        taken.add("completion")
    elif positional or any(p.kind == p.VAR_POSITIONAL for p in params):
        completion = "positional"  # the first positional parameter, whatever its name
        if positional:
            taken.add(positional[0].name)
    else:
        completion = "none"
    keyword_names = {p.name for p in params if p.kind in by_keyword and p.name not in taken}
    inputs = INPUT_FIELDS if var_keyword else tuple(f for f in INPUT_FIELDS if f in keyword_names)
    settable = frozenset(keyword_names - set(INPUT_FIELDS) - {"completion"})
    required = frozenset(p.name for p in params if p.name in settable and p.default is p.empty)
    return _Signature(completion, var_keyword, inputs, settable, required)


def check_params(spec: RewardSpec, params: Mapping[str, Any]) -> None:
    """Raise RewardParamError if ``params`` do not fit ``spec``'s function (names, then values)."""
    sig = _inspect(spec.fn)
    for key in params:
        if key in INPUT_FIELDS or key == "completion":
            raise RewardParamError(
                key, f"'{key}' is supplied by the engine for every completion; remove it from params"
            )
        if key in sig.settable or (sig.var_keyword and not spec.builtin):
            continue
        if sig.settable:
            close = difflib.get_close_matches(key, sorted(sig.settable), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            known = f"{hint}'{spec.name}' accepts: {', '.join(sorted(sig.settable))}"
        else:
            known = f"'{spec.name}' takes no parameters"
        raise RewardParamError(key, f"unknown parameter; {known}")
    for key in sorted(sig.required - set(params)):
        raise RewardParamError(key, f"required by '{spec.name}'; set it in params")
    if spec.check is not None:
        spec.check(dict(params))


def make_caller(fn: Callable[..., Any], params: Mapping[str, Any]) -> Callable[[ItemTuple], Any]:
    """A function of one item tuple that calls ``fn`` with what its signature accepts plus params."""
    sig = _inspect(fn)
    fixed = dict(params)
    pairs = tuple((name, INPUT_FIELDS.index(name) + 1) for name in sig.inputs)

    if sig.completion == "positional":

        def call(item: ItemTuple) -> Any:
            kwargs = {name: item[i] for name, i in pairs}
            kwargs.update(fixed)
            return fn(item[0], **kwargs)

    else:
        with_completion = sig.completion == "keyword"

        def call(item: ItemTuple) -> Any:
            kwargs = {name: item[i] for name, i in pairs}
            if with_completion:
                kwargs["completion"] = item[0]
            kwargs.update(fixed)
            return fn(**kwargs)

    return call
