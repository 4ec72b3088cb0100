"""How workflows read what they are sent: any arity, any payload, never a raise
that would fail a workflow task.

The SDK calls a handler with whatever the sender chose: no argument, two, a
JSON `null`, a protobuf. Our handlers therefore take `*args` (so the SDK does no
conversion by type hint that could fail) and read them here: the expected
number of arguments, plain JSON within a size limit, then the pydantic model.
Everything wrong becomes `Refused` with the field and the reason.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from agentroster.contracts import json_size
from agentroster.wire import refusal_reason

M = TypeVar("M", bound=BaseModel)

# Arguments of one signal or update, as JSON: far below the server's 2 MiB per
# payload, so no accepted message can make a reply or a history event too big.
MAX_MESSAGE_BYTES = 512 * 1024


class Refused(ValueError):
    """A message that cannot be applied: the reason names the field."""


def one(kind: str, args: tuple[Any, ...], *, optional: bool = False) -> Any:
    """The single argument of a message (None when `optional` and absent)."""
    if optional and not args:
        return None
    if len(args) != 1:
        raise Refused(f"{kind}: expected 1 argument, got {len(args)}")
    return args[0]


def plain(kind: str, raw: Any) -> Any:
    """`raw` as plain JSON within MAX_MESSAGE_BYTES (Refused otherwise)."""
    if isinstance(raw, BaseModel):  # sent from workflow code in this worker
        raw = raw.model_dump(mode="json")
    try:
        size = json_size(raw)
    except ValueError as exc:
        raise Refused(f"{kind}: {type(raw).__name__} {exc}") from exc
    if size > MAX_MESSAGE_BYTES:
        raise Refused(f"{kind}: the argument is {size} bytes as JSON, over the {MAX_MESSAGE_BYTES}-byte limit")
    return raw


def model(kind: str, cls: type[M], raw: Any, *, lenient: bool = False) -> M:
    """`raw` validated as `cls`; Refused names the field and the reason.

    `lenient` is for update handlers, whose arguments a validator already
    accepted: an update accepted under older, looser rules (a recorded history
    being replayed) is read as it was then rather than failing the replay.
    """
    if not lenient:
        raw = plain(kind, raw)
    if not isinstance(raw, dict):
        raise Refused(f"{kind}: expected a JSON object, got {type(raw).__name__}")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        if lenient:
            return cls.model_construct(**{k: v for k, v in raw.items() if k in cls.model_fields})
        raise Refused(f"{kind}: {refusal_reason(exc)}") from exc


def models(kind: str, cls: type[M], raw: Any, *, at_most: int, lenient: bool = False) -> list[M]:
    """A non-empty JSON list of `cls`, at most `at_most` long."""
    if not lenient:
        raw = plain(kind, raw)
    if not isinstance(raw, list) or not (lenient or 1 <= len(raw) <= at_most):
        count = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise Refused(f"{kind}: expected a list of 1 to {at_most} objects, got {count}")
    return [model(f"{kind}[{i}]", cls, item, lenient=lenient) for i, item in enumerate(raw)]


def text(kind: str, raw: Any, *, field: str, max_length: int = 256) -> str:
    """A non-empty string of at most `max_length` characters (`field` names it in the refusal)."""
    if not isinstance(raw, str) or not raw or len(raw) > max_length:
        shown = f"{len(raw)} characters" if isinstance(raw, str) else type(raw).__name__
        raise Refused(f"{kind}: {field}: expected a non-empty string of at most {max_length} characters, got {shown}")
    return raw
