"""Tributary's client library: log any training script into a Tributary run, W&B-style.

    import tributary

    with tributary.init(project="my-project", config={"lr": 1e-6}) as run:
        for step in range(100):
            ...
            run.log({"reward/mean": reward, "actor/entropy": entropy}, step=step)
            if run.should_stop():  # Cancel on the run's page
                break

Offline first: events go to ``./tributary-runs/<id>/events.jsonl`` and ship from a background
thread when ``TRIBUTARY_URL`` and ``TRIBUTARY_TOKEN`` name a reachable web app;
``python -m tributary sync DIR`` sends a run written offline. A run another script holds (its
directory copied and running elsewhere) raises ``RunRefused``. Standard library plus
``websockets``: no Django, no torch.
"""

from tributary.run import Run, RunRefused, init

__all__ = ["Run", "RunRefused", "init"]
__version__ = "0.1.0"
