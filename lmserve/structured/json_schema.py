"""Which JSON Schema keywords lmserve enforces, checked before compiling.

xgrammar compiles a schema to a grammar, and silently ignores the keywords it cannot express
(``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``, ``dependentRequired``, a length
beside a ``pattern``, several ``allOf`` branches, unknown formats): the output would then break
the schema the caller believes enforced. So every keyword is checked against what the grammar
enforces (measured on xgrammar 0.2.9: each refused keyword let an invalid instance through), and
anything else is refused with the JSON pointer of the subschema at fault.
"""

from __future__ import annotations

from typing import Any

# Keywords that only describe: they never change which instances are valid.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
    "readOnly", "writeOnly", "discriminator", "contentMediaType", "contentEncoding",
})
# Keywords the grammar enforces.
ENFORCED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "unevaluatedProperties", "minProperties", "maxProperties", "items",
    "prefixItems", "unevaluatedItems", "minItems", "maxItems", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
    "format", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
})
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference", "ipv4",
    "ipv6", "hostname", "json-pointer", "relative-json-pointer",
})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE = ("additionalProperties", "propertyNames", "unevaluatedProperties", "items", "unevaluatedItems")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


class SchemaError(ValueError):
    """A schema lmserve cannot enforce; ``pointer`` is the JSON pointer of the part at fault."""

    def __init__(self, pointer: str, message: str) -> None:
        super().__init__(f"{pointer or '/'}: {message}")
        self.pointer = pointer


def check_schema(schema: Any) -> None:
    """Refuse ``schema`` unless every keyword in it is enforced by the grammar it compiles to.

    Raises ``SchemaError`` naming the JSON pointer of the first subschema at fault and why.
    """
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        stack.extend(_check_node(node, pointer))


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _check_node(node: Any, pointer: str) -> list[tuple[Any, str]]:
    """Check one subschema; returns its subschemas to check next."""
    if isinstance(node, bool):
        return []
    if not isinstance(node, dict):
        raise SchemaError(pointer, f"a schema must be an object or a boolean, got {node!r}")
    for key in node:
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise SchemaError(f"{pointer}/{_escape(key)}", f"keyword {key!r} is not enforced by "
                              f"lmserve's JSON grammar, so the output could break it")
    types = node.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in TYPES:
            raise SchemaError(f"{pointer}/type", f"unknown type {t!r} (types: {', '.join(sorted(TYPES))})")
    if "format" in node and node["format"] not in FORMATS:
        raise SchemaError(f"{pointer}/format", f"format {node['format']!r} is not enforced (formats "
                          f"enforced: {', '.join(sorted(FORMATS))})")
    for shape in ("pattern", "format"):
        length = next((k for k in ("minLength", "maxLength") if k in node), None)
        if shape in node and length:
            raise SchemaError(f"{pointer}/{length}", f"{length} beside {shape} is not enforced")
    if len(node.get("allOf", ())) > 1:
        raise SchemaError(f"{pointer}/allOf", "allOf with more than one schema is not enforced")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise SchemaError(f"{pointer}/$ref", f"only references within the schema (#/...) are "
                          f"resolved, got {ref!r}")
    children: list[tuple[Any, str]] = []
    for key in _ONE:
        if key in node:
            children.append((node[key], f"{pointer}/{key}"))
    for key in _LIST:
        if key in node:
            if not isinstance(node[key], list):
                raise SchemaError(f"{pointer}/{key}", f"{key} must be a list of schemas")
            children += [(s, f"{pointer}/{key}/{i}") for i, s in enumerate(node[key])]
    for key in _MAP:
        if key in node:
            if not isinstance(node[key], dict):
                raise SchemaError(f"{pointer}/{key}", f"{key} must map names to schemas")
            children += [(s, f"{pointer}/{key}/{_escape(k)}") for k, s in node[key].items()]
    return children
