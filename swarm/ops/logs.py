"""Process logging: readable lines by default, one JSON object per line with ``--log-format json``.

Every record carries the process's context (a node's id and the stages it hosts), so
lines from many volunteers can be merged and filtered. Operator messages (``say``) go
to stdout, diagnostics (warnings, errors) to stderr, both in the chosen format.

Importing this module also quiets gRPC's C core, which otherwise prints a line each time
hivemind starts its ``p2pd`` daemon ("skipping fork() handlers"): this process never
uses gRPC in a forked child (the child execs at once), so gRPC's fork handlers are off.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

FORMATS = ("text", "json")
OPERATOR = "swarm.operator"  # the logger of say(): stdout, INFO
_context: dict[str, str] = {}


def set_context(**fields: object) -> None:
    """Fields every later record carries (e.g. ``node="ab12cd34", stages="0,1"``); None removes one."""
    for key, value in fields.items():
        if value is None:
            _context.pop(key, None)
        else:
            _context[key] = str(value)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        context = " ".join(f"{k}={v}" for k, v in _context.items())
        head = f"{stamp} {record.levelname:<7} {record.name}"
        line = f"{head} [{context}] {record.getMessage()}" if context else f"{head} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            **_context,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(fmt: str = "text", level: int = logging.WARNING) -> None:
    """Configure this process: diagnostics at ``level`` and up to stderr, operator lines to stdout."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {FORMATS}")
    formatter = _JsonFormatter() if fmt == "json" else _TextFormatter()
    errors = logging.StreamHandler(sys.stderr)
    errors.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [errors]
    root.setLevel(level)
    operator = logging.getLogger(OPERATOR)
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(formatter)
    operator.handlers[:] = [out]
    operator.setLevel(logging.INFO)
    operator.propagate = False


def say(message: str) -> None:
    """One line for operators on stdout (``swarm up`` relays it), or a plain print before :func:`setup`."""
    operator = logging.getLogger(OPERATOR)
    if operator.handlers:
        operator.info(message)
    else:
        print(message, flush=True)
