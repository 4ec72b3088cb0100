"""The names an A2A agent's registration and its agent workflow share (vocabulary: imports nothing of ours).

An agent registered from its Agent Card (`agentroster.client.a2a`) carries
`metadata = {"protocol": "a2a", "card_url": ...}`; the invoke step sends its tasks
over A2A and its agent workflow checks it by reading that card (`check_a2a_agent`).
"""

from __future__ import annotations

from typing import Any

PROTOCOL = "a2a"
PROTOCOL_KEY = "protocol"
CARD_URL_KEY = "card_url"
CARD_PATH = "/.well-known/agent-card.json"
# The card extension that carries each skill's version and JSON Schemas:
# params {skill_id: {version, input_schema, output_schema}}.
SCHEMAS_EXTENSION = "urn:agentroster:skill-schemas"
JSONRPC = "JSONRPC"
# The activity an A2A agent's workflow runs every heartbeat interval (`activities/a2a.py`).
CHECK_A2A_AGENT = "check_a2a_agent"
# The reason an A2A agent that has not answered for 3 intervals ends with.
UNREACHABLE_REASON = "a2a_unreachable"


def is_a2a(metadata: dict[str, Any] | None) -> bool:
    """Whether a registration's metadata says the agent is served over A2A (registered from its card)."""
    return isinstance(metadata, dict) and metadata.get(PROTOCOL_KEY) == PROTOCOL


def card_url_of(metadata: dict[str, Any] | None, endpoint: str) -> str:
    """The card an A2A agent's liveness check reads: the one it registered from, else its endpoint's."""
    url = metadata.get(CARD_URL_KEY) if isinstance(metadata, dict) else None
    return url if isinstance(url, str) and url else endpoint.rstrip("/") + CARD_PATH
