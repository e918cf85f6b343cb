"""Tributary's RL engine: a plain Python + torch library with its own CLI (``python -m engine``)."""
