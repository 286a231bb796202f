"""Where a join token comes from: ``--token-file`` or ``$SWARM_TOKEN``, never a log line.

A token on the command line (``--token``) still works but is visible to every local user
in ``ps``; it gets a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

ENV = "SWARM_TOKEN"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", help=f"file holding the join token (default: ${ENV})")
    parser.add_argument(
        "--token", help="join token on the command line (visible in ps: prefer the two above)"
    )


def from_args(args: argparse.Namespace, prog: str) -> str | None:
    """:func:`resolve`, or exit with ``prog``'s message when the token file cannot be read."""
    try:
        return resolve(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{prog}: cannot read the join token: {e}") from None


def resolve(args: argparse.Namespace) -> str | None:
    """The token from ``--token``, ``--token-file`` or the environment, in that order; None if none."""
    if args.token:
        log.warning("a join token on the command line is visible to every local user (ps): use $%s", ENV)
        return args.token
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
        if not token:
            raise ValueError(f"token file {args.token_file} is empty")
        return token
    return os.environ.get(ENV) or None
