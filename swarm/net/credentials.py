"""The call metadata that carries a node's session credential to the coordinator."""

from __future__ import annotations

NODE_KEY = "swarm-node"
SESSION_KEY = "swarm-session"


def session_metadata(node_id: str, session: str) -> tuple[tuple[str, str], ...]:
    """The metadata of every call a node makes after Join (``session``: ``JoinReply.session``)."""
    return ((NODE_KEY, node_id), (SESSION_KEY, session))
