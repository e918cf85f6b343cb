"""Other trainers' metric names, and the names the run page's default panels draw.

The panels (``webapp/pages/static/tributary/charts.js``) take the engine's names, which are
verl's: ``reward/mean`` (and ``reward/<component>/mean``), ``actor/entropy``, ``actor/kl_loss``,
``actor/pg_clipfrac``, ``response_length/mean`` with ``response_length/clip_ratio``,
``actor/grad_norm``, ``actor/lr``.

- verl logs its names already, but its reward statistics are ``critic/score/*`` (the reward
  function's sequence score, what the engine calls ``reward/*``): ``verl_values`` adds those under
  the engine's names too, and keeps verl's.
- TRL logs its own names (``reward``, ``kl``, ``completions/mean_length``, ...): ``trl_name``
  renames them; a name it does not know passes through unchanged.
"""

from __future__ import annotations

import re

# verl's name -> the engine's name, added beside verl's when the file does not have it already.
VERL_ALIASES = {
    "critic/score/mean": "reward/mean",
    "critic/score/max": "reward/max",
    "critic/score/min": "reward/min",
}

# TRL 1.16 GRPOTrainer / transformers Trainer -> the engine's names.
TRL_NAMES = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "kl": "actor/kl_loss",  # GRPO's KL penalty to the reference (k3), verl's use_kl_loss term
    "entropy": "actor/entropy",
    "completions/mean_length": "response_length/mean",
    "completions/min_length": "response_length/min",
    "completions/max_length": "response_length/max",
    "completions/clipped_ratio": "response_length/clip_ratio",  # truncated at max_completion_length
    "clip_ratio/region_mean": "actor/pg_clipfrac",  # tokens whose ratio was clipped, either side
    "clip_ratio/low_mean": "actor/pg_clipfrac_lower",
    "policy_loss": "actor/pg_loss",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
}
# ``rewards/<function>/mean`` -> ``reward/<function>/mean`` (the Reward panel draws components).
_TRL_REWARD_FUNCTION = re.compile(r"^rewards/(.+)/(mean|std)$")


def verl_values(values: dict[str, float]) -> dict[str, float]:
    """verl's metrics plus the engine's names of its reward statistics (when absent)."""
    for source, target in VERL_ALIASES.items():
        if source in values and target not in values:
            values[target] = values[source]
    return values


def trl_name(name: str) -> str:
    """The engine's name of a TRL/transformers metric; evaluation's ``eval_`` prefix becomes
    ``eval/`` (the engine's evaluation prefix); unknown names are returned unchanged."""
    if name.startswith("eval_"):
        return "eval/" + trl_name(name[len("eval_") :])
    if name in TRL_NAMES:
        return TRL_NAMES[name]
    match = _TRL_REWARD_FUNCTION.match(name)
    if match:
        return f"reward/{match.group(1)}/{match.group(2)}"
    return name
