"""Schemas rewritten for constrained decoding, without a model: objects closed to keys
they never declared (as OpenAI's strict mode reads them), what allows other keys kept."""

from __future__ import annotations

from typing import Any

from kvrt._chat.schemas import closed_objects

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}}


def test_objects_that_declare_properties_are_closed_at_every_depth() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "home": ADDRESS,
            "others": {"type": "array", "items": {"$ref": "#/$defs/Address"}},
            "either": {"anyOf": [ADDRESS, {"type": "null"}]},
            # a property named as a keyword is a property, not the keyword
            "properties": {"type": "string"},
        },
        "$defs": {"Address": ADDRESS},
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["home"]["additionalProperties"] is False
    assert out["$defs"]["Address"]["additionalProperties"] is False
    assert out["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["properties"]["properties"] == {"type": "string"}
    assert out["properties"]["others"] == schema["properties"]["others"]
    assert "additionalProperties" not in ADDRESS  # the caller's schema is left alone


def test_objects_that_allow_other_keys_keep_them() -> None:
    for schema in [
        {"type": "object"},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"enum": [{"properties": {"a": 1}}]},  # data, not a schema
    ]:
        assert closed_objects(schema) == schema
