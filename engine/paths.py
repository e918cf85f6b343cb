"""Where the engine keeps its own data (starter policies and other local builds).

``data_dir()`` is ``$TRIBUTARY_DATA_DIR`` when set, else ``~/.cache/tributary``. Nothing
is created on import; callers create the sub-directories they need.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "TRIBUTARY_DATA_DIR"


def data_dir() -> Path:
    """The engine's data directory (not created here)."""
    value = os.environ.get(DATA_DIR_ENV, "").strip()
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "tributary"


def starter_dir() -> Path:
    """Where starter policies are cached: ``data_dir()/starter``."""
    return data_dir() / "starter"
