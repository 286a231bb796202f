"""Command lines that one of the swarm's CLIs parses, built from typed values (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def command_line(
    command: str, options: Mapping[str, object], use_dht: bool, security: Sequence[str]
) -> list[str]:
    """``command`` with ``--flag value`` for every option not None, ``--no-dht`` unless ``use_dht``,
    then the transport ``security`` flags."""
    args = [x for flag, value in options.items() if value is not None for x in (flag, str(value))]
    return [command, *args, *([] if use_dht else ["--no-dht"]), *security]
