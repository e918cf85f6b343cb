"""Which reward functions a run may name: running code is a deployment's decision, not a launch field.

A reward function given as ``package.module:function`` is imported and called by the engine, so
whoever may write that string may run any code importable on the worker: ``timeit:timeit`` with
``params: {setup: "<python>"}`` runs the ``setup`` string. On a shared deployment the people who
write configs (team members) are not the people who decide what code the workers run (whoever
deploys them), so the config check takes a ``RewardPolicy``:

- the registered built-ins (``math``, ``exact_match``, ``task``, ...) are always allowed;
- ``modules``: the deployment's own reward modules (``TRIBUTARY_REWARD_MODULES``, a
  comma-separated list of module names). A run may name any public function *defined* in one of
  them (``mypkg.rewards:score``); a name the module merely imports (``mypkg.rewards:timeit`` after
  ``from timeit import timeit``) is refused when the function is loaded;
- ``allow_any``: any ``module:function``. The engine's own CLI allows it (whoever runs the CLI
  already runs their own code); a worker denies it (``TRIBUTARY_USER_REWARDS=deny``) unless the web
  app says the run was launched by an admin of a team the deployment trusts with user code.

The policy is checked twice: by the web app before a run is stored, and by the engine on the
worker before it imports anything (the worker trusts only its own environment).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

USER_REWARDS_ENV = "TRIBUTARY_USER_REWARDS"
"""``allow`` (the CLI's default) or ``deny``: whether any ``module:function`` may be named."""

REWARD_MODULES_ENV = "TRIBUTARY_REWARD_MODULES"
"""Comma-separated modules whose functions runs may name (the deployment's reward modules)."""


def parse_modules(raw: str | Iterable[str]) -> frozenset[str]:
    """Module names from ``"a.b, c"`` or an iterable; raises ValueError for a malformed name."""
    names = raw.split(",") if isinstance(raw, str) else list(raw)
    out = set()
    for name in (n.strip() for n in names):
        if not name:
            continue
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(
                f"{REWARD_MODULES_ENV}: {name!r} is not a module name (dotted identifiers, e.g. mypkg.rewards)"
            )
        out.add(name)
    return frozenset(out)


@dataclass(frozen=True)
class RewardPolicy:
    """What a run may name besides the built-ins; see the module docstring."""

    modules: frozenset[str] = frozenset()
    allow_any: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RewardPolicy:
        """The policy of this process: ``TRIBUTARY_USER_REWARDS`` and ``TRIBUTARY_REWARD_MODULES``."""
        raw = environ.get(USER_REWARDS_ENV, "").strip().lower() or "allow"
        if raw not in ("allow", "deny"):
            raise ValueError(f"{USER_REWARDS_ENV}={raw!r}: use allow or deny")
        return cls.of_deployment(allow_any=raw == "allow", environ=environ)

    @classmethod
    def of_deployment(cls, *, allow_any: bool, environ: Mapping[str, str] = os.environ) -> RewardPolicy:
        """The deployment's reward modules (``TRIBUTARY_REWARD_MODULES``) with ``allow_any`` decided
        by the caller: the web app and the worker never take it from their own environment."""
        return cls(modules=parse_modules(environ.get(REWARD_MODULES_ENV, "")), allow_any=allow_any)

    def names_own_code(self, refs: Iterable[str]) -> bool:
        """Whether any ``module:function`` in ``refs`` needs ``allow_any`` under this policy's modules."""
        strict = RewardPolicy(modules=self.modules, allow_any=False)
        for ref in refs:
            if ":" in ref:
                try:
                    strict.check_name(ref)
                except ValueError:
                    return True
        return False

    def as_env(self) -> dict[str, str]:
        """The environment variables that give a child process this policy."""
        return {
            USER_REWARDS_ENV: "allow" if self.allow_any else "deny",
            REWARD_MODULES_ENV: ",".join(sorted(self.modules)),
        }

    def check_name(self, ref: str) -> None:
        """Raise ValueError unless ``module:function`` may be named under this policy."""
        if self.allow_any:
            return
        module, _, attr = ref.partition(":")
        if module in self.modules:
            if attr.startswith("_") or "._" in attr:
                raise ValueError(f"'{ref}' is private: name a public function of {module}")
            return
        listed = (
            f"this deployment's reward modules are {', '.join(sorted(self.modules))}"
            if self.modules
            else "this deployment lists no reward modules"
        )
        raise ValueError(
            f"'{ref}' is not a registered reward function, and {listed}: a run may name only "
            f"registered rewards or functions of those modules. Ask whoever runs the workers to add "
            f"'{module}' to {REWARD_MODULES_ENV} (on the web app and the workers), or to let your team's "
            "admins run their own reward code"
        )

    def check_loaded(self, ref: str, fn: Callable[..., Any]) -> None:
        """After import: a function named through a listed module must be defined there (not
        re-exported from elsewhere, such as ``timeit`` imported into the module)."""
        if self.allow_any:
            return
        module = ref.partition(":")[0]
        defined_in = getattr(fn, "__module__", None)
        if defined_in != module:
            raise ValueError(
                f"'{ref}' is defined in {defined_in or 'an unknown module'}, not in {module}: only "
                f"functions written in {module} may be named"
            )
