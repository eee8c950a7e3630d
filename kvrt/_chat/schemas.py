"""JSON Schemas rewritten for constrained decoding: numbers bounded where the schema
leaves them unbounded, and a schema embedded in a larger one (a tool's parameters in a
reply's grammar) with its ``$ref`` rebased. Pure: no grammar engine here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DIGITS",
    "FRACTION_DIGITS",
    "bounded_numbers",
    "closed_objects",
    "embed_schema",
    "number",
    "with_defs",
]

_DATA = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a ``$ref`` or ``type`` inside them
is data."""


DIGITS = 16
"""The most digits a number's integer part may have where its schema sets no bound (as
llama.cpp's schema converter allows): a greedy model asked for an unbounded integer would
otherwise write digits until its token limit."""
FRACTION_DIGITS = 10
"""The most digits after a number's decimal point where its schema sets no ``multipleOf``
(the finest step the grammar engine's ``multipleOf`` follows; it writes no exponent then)."""
_LARGEST = 10**DIGITS - 1


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with a bound on each ``integer`` and ``number`` it leaves unbounded:
    :data:`DIGITS` digits each side of zero, :data:`FRACTION_DIGITS` after the point.
    Bounds the schema sets are kept (any of the four keywords keeps that side)."""
    if isinstance(schema, list):
        return [bounded_numbers(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA else bounded_numbers(v)) for k, v in schema.items()}
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if kinds & {"integer", "number"}:
        low = number(schema.get("minimum", schema.get("exclusiveMinimum")))
        high = number(schema.get("maximum", schema.get("exclusiveMaximum")))
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = min(-_LARGEST, high) if high is not None else -_LARGEST
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = max(_LARGEST, low) if low is not None else _LARGEST
        if "number" in kinds and "multipleOf" not in schema:
            out["multipleOf"] = 10.0**-FRACTION_DIGITS
    return out


_SCHEMA_MAPS = frozenset(
    {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}
)
"""Keywords whose value maps names to schemas."""
_SUBSCHEMAS = frozenset(
    {
        "items",
        "prefixItems",
        "additionalItems",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
    }
)
"""Keywords whose value is a schema or a list of schemas."""
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """``schema`` with each object that declares ``properties`` and says nothing of other
    keys closed to them (``additionalProperties: false``), as OpenAI's strict mode reads a
    tool's parameters: a small model under a grammar otherwise adds keys the schema never
    declared, and a Python tool called with them raises. An object that allows other keys
    (``additionalProperties`` true or a schema, ``patternProperties``) keeps them; one that
    declares no properties (``{"type": "object"}``) stays any object."""
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(v) for name, v in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


def number(value: Any) -> int | float | None:
    """``value`` where it is a JSON number (not a bool), else None."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _local_refs(node: Any) -> bool:
    """Whether a JSON Schema refers within itself (``$ref`` to ``#...``)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_local_refs(v) for k, v in node.items() if k not in _DATA)
    if isinstance(node, list):
        return any(_local_refs(v) for v in node)
    return False


def _rebased(node: Any, base: str) -> Any:
    """``node`` with each local ``$ref`` (``#``, ``#/$defs/X``) made relative to ``base``,
    the pointer where ``node`` will sit inside a larger schema."""
    if isinstance(node, dict):
        out = {k: (v if k in _DATA else _rebased(v, base)) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = "#" + base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


def embed_schema(schema: Mapping[str, Any], name: str, defs: dict[str, Any]) -> Any:
    """``schema`` as a part of a larger one whose root will hold ``defs`` as its
    ``$defs``: itself where it refers to nothing within itself, else a ``$ref`` to
    ``defs[name]``, where it is kept with its references rebased (a pydantic model's
    nested models, ``$defs``/``$ref``, resolve against the root they were written for)."""
    if not _local_refs(schema):
        return schema
    defs[name] = _rebased(schema, f"/$defs/{name}")
    return {"$ref": f"#/$defs/{name}"}


def with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` holding ``defs`` (from :func:`embed_schema`) at its root."""
    return {**schema, "$defs": defs} if defs else schema
