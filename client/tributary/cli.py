"""``python -m tributary <command>`` (also the ``tributary`` script of the client's package).

Subcommands register in ``COMMANDS``: the module that defines one exposes ``COMMAND`` (a
``Command``), and one line here names that module. Modules are imported only when the command
line is parsed, so ``import tributary`` stays light.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tributary.api import Api


@dataclass(frozen=True)
class Command:
    """One subcommand: its name and one-line help, its arguments, and what runs it (an exit code)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# name -> the module whose COMMAND it is.
COMMANDS: dict[str, str] = {
    "sync": "tributary.sync",
    "follow": "tributary.integrations.follow",
}


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--token``, defaulting to ``TRIBUTARY_URL`` and ``TRIBUTARY_TOKEN``."""
    parser.add_argument("--url", default=None, help="the web app's address (default: $TRIBUTARY_URL)")
    parser.add_argument("--token", default=None, help="a personal API token (default: $TRIBUTARY_TOKEN)")


def server_api(args: argparse.Namespace) -> Api:
    """The API named by ``--url``/``--token`` or the environment; ``SystemExit`` naming the fix."""
    url = args.url or os.environ.get("TRIBUTARY_URL", "")
    token = args.token or os.environ.get("TRIBUTARY_TOKEN", "")
    if not url:
        raise SystemExit("tributary: no server: set TRIBUTARY_URL or pass --url (the web app's address)")
    if not token:
        raise SystemExit(
            "tributary: no API token: set TRIBUTARY_TOKEN or pass --token (make one on the web app's account page)"
        )
    try:
        return Api(url, token)
    except ValueError as exc:
        raise SystemExit(f"tributary: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m tributary", description="Tributary's client library.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, Command] = {}
    for name, module in COMMANDS.items():
        command: Command = importlib.import_module(module).COMMAND
        commands[name] = command
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    args = parser.parse_args(argv)
    return commands[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
