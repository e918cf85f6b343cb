"""Other trainers' runs in Tributary.

- ``tributary.integrations.verl``: pure readers of verl's own output (its ``file`` logger's JSONL
  and ``trainer.rollout_data_dir`` dumps), shared by ``follow`` and the web app's import.
- ``tributary.integrations.follow``: ``python -m tributary follow``, which tails a live verl run
  into a Tributary run (no change to the training code).
- ``tributary.integrations.trl``: ``TributaryCallback``, a ``transformers.TrainerCallback`` for
  TRL and plain transformers trainers (transformers is imported only there).
- ``tributary.integrations.names``: their metric names, mapped to the panels the run page draws.
"""
