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

from agentroster.errors import MESSAGE_MAX_BYTES
from agentroster.models import json_size
from agentroster.vocabulary.wire import refusal_reason

M = TypeVar("M", bound=BaseModel)

MAX_MESSAGE_BYTES = MESSAGE_MAX_BYTES  # arguments of one signal or update, as JSON


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


def model(kind: str, cls: type[M], raw: Any) -> M:
    """`raw` validated as `cls`; Refused names the field and the reason (never the value sent)."""
    raw = plain(kind, raw)
    if not isinstance(raw, dict):
        raise Refused(f"{kind}: expected a JSON object, got {type(raw).__name__}")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise Refused(f"{kind}: {refusal_reason(exc)}") from exc


def listed(kind: str, raw: Any, *, what: str, at_most: int, at_least: int = 1) -> list[Any]:
    """`raw` as a plain JSON list of `at_least` to `at_most` items (`what`: their name in the refusal)."""
    raw = plain(kind, raw)
    if not isinstance(raw, list) or not at_least <= len(raw) <= at_most:
        count = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise Refused(f"{kind}: expected a list of {at_least} to {at_most} {what}, got {count}")
    return raw


def models(kind: str, cls: type[M], raw: Any, *, at_most: int) -> list[M]:
    """A non-empty JSON list of `cls`, at most `at_most` long."""
    return [model(f"{kind}[{i}]", cls, item) for i, item in enumerate(listed(kind, raw, what="objects", at_most=at_most))]


def texts(kind: str, raw: Any, *, field: str, at_most: int, max_length: int = 256, at_least: int = 1) -> list[str]:
    """A JSON list of `at_least` (default 1) to `at_most` strings, each as `text` reads it."""
    items = listed(kind, raw, what=f"{field}s", at_most=at_most, at_least=at_least)
    return [text(kind, item, field=field, max_length=max_length) for item in items]


def text(kind: str, raw: Any, *, field: str, max_length: int = 256) -> str:
    """A non-empty string of at most `max_length` characters (`field` names it in the refusal)."""
    if not isinstance(raw, str) or not raw or len(raw) > max_length:
        shown = f"{len(raw)} characters" if isinstance(raw, str) else type(raw).__name__
        raise Refused(f"{kind}: {field}: expected a non-empty string of at most {max_length} characters, got {shown}")
    return raw
