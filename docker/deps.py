"""Print the project's pinned dependencies (``pyproject.toml``), one a line, for the images.

The images install the dependencies in a layer of their own, before the source is copied, so
a change to the code does not reinstall them. torch comes first and from a PyTorch index
(PyPI's Linux wheel is the CUDA build, far too big for the CPU images):

    python deps.py torch         # the torch pin alone: torch==2.13.0
    python deps.py --no-torch    # every other pin (torch already installed satisfies them)
    python deps.py --no-torch --extra bench   # plus an optional extra's pins
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path


def pins(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    found = list(project["dependencies"])
    for extra in extras:
        optional = project.get("optional-dependencies", {})
        if extra not in optional:
            raise SystemExit(
                f"pyproject.toml has no extra {extra!r}: choose one of {', '.join(sorted(optional))}"
            )
        found += optional[extra]
    return found


def is_torch(requirement: str) -> bool:
    name = requirement.split(";")[0].split("[")[0]
    for sep in ("==", ">=", "<=", "~=", "!=", ">", "<"):
        name = name.split(sep)[0]
    return name.strip().lower() == "torch"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", nargs="?", choices=["torch", "all"], default="all")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out")
    parser.add_argument("--extra", action="append", default=[], help="add an optional extra's pins")
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    args = parser.parse_args()
    found = pins(args.pyproject, args.extra)
    if args.what == "torch":
        found = [r for r in found if is_torch(r)]
        if not found:
            raise SystemExit("pyproject.toml pins no torch")
    elif args.no_torch:
        found = [r for r in found if not is_torch(r)]
    print("\n".join(found))


if __name__ == "__main__":
    main()
