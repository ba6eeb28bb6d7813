"""Which JSON Schema keywords lmserve enforces, checked before compiling.

xgrammar compiles a schema to a grammar, and silently ignores the keywords it cannot express
(``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``, ``dependentRequired``, a length
beside a ``pattern``, several ``allOf`` branches, unknown formats) and keywords beside some
others (anything beside ``$ref``, ``enum``, ``const`` or ``anyOf``/``oneOf``/``allOf``;
``multipleOf`` on numbers; ``required`` names without a ``properties`` entry): the output would
then break the schema the caller believes enforced. So every keyword is checked against what the
grammar enforces (measured on xgrammar 0.2.9: each refused case let an invalid instance through),
and anything else is refused with the JSON pointer of the subschema at fault.
"""

from __future__ import annotations

from typing import Any, Union

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
# Keywords that stand for the whole subschema: xgrammar ignores validation keywords beside them.
_EXCLUSIVE = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf")
# Keywords that may stand beside the exclusive ones (they hold definitions, not rules).
_BESIDE_ANY = frozenset({"$defs", "definitions"})
_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


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


def _check_shapes(node: dict[str, Any], pointer: str) -> None:
    """Refuse keyword values of the wrong JSON type (``"type": {...}``, ``"required": "a"``)."""
    shapes: dict[str, Union[type, tuple[type, ...]]]
    shapes = {"type": (str, list), "format": str, "pattern": str, "required": list, "enum": list,
              "$ref": str, "minimum": (int, float), "maximum": (int, float),
              "exclusiveMinimum": (int, float), "exclusiveMaximum": (int, float),
              "multipleOf": (int, float), "minLength": int, "maxLength": int, "minItems": int,
              "maxItems": int, "minProperties": int, "maxProperties": int}
    for key, shape in shapes.items():
        value = node.get(key)
        if key in node and (not isinstance(value, shape) or isinstance(value, bool)):
            raise SchemaError(f"{pointer}/{_escape(key)}", f"{key} cannot be {value!r}")
    for key in ("type", "required"):
        if isinstance(node.get(key), list) and not all(isinstance(v, str) for v in node[key]):
            raise SchemaError(f"{pointer}/{key}", f"{key} must list strings, got {node[key]!r}")


def _types(node: dict[str, Any], pointer: str) -> list[str]:
    """The node's ``type`` as a list (empty when it has none), each checked."""
    types = node.get("type")
    types = types if isinstance(types, list) else [types] if types is not None else []
    for t in types:
        if t not in TYPES:
            raise SchemaError(f"{pointer}/type", f"unknown type {t!r} (types: {', '.join(sorted(TYPES))})")
    return types


def _check_exclusive(node: dict[str, Any], pointer: str, types: list[str]) -> None:
    """``$ref``, ``enum``, ``const`` and the combinators stand alone: a rule beside them would be
    ignored. The one exception is a ``type`` that every ``enum``/``const`` value already has
    (pydantic writes one beside an enum)."""
    exclusive = [k for k in _EXCLUSIVE if k in node]
    if not exclusive:
        return
    rules = [k for k in node if k in ENFORCED and k not in _BESIDE_ANY and k != exclusive[0]]
    if rules == ["type"] and exclusive[0] in ("enum", "const"):
        values = node["enum"] if exclusive[0] == "enum" else [node["const"]]
        if all(any(_has_type(v, t) for t in types) for v in values):
            return
        raise SchemaError(f"{pointer}/type", f"{exclusive[0]} holds a value that is not of type "
                          f"{node['type']!r}")
    if rules:
        raise SchemaError(f"{pointer}/{_escape(rules[0])}", f"{rules[0]} beside {exclusive[0]} is not "
                          f"enforced (put it inside the {exclusive[0]}, or drop one)")


def _has_type(value: Any, json_type: str) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[json_type])


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
    _check_shapes(node, pointer)
    types = _types(node, pointer)
    _check_exclusive(node, pointer, types)
    if "multipleOf" in node and types != ["integer"]:
        raise SchemaError(f"{pointer}/multipleOf", 'multipleOf is enforced only with "type": "integer"')
    missing = [n for n in node.get("required", ()) if n not in node.get("properties", {})]
    if missing:
        raise SchemaError(f"{pointer}/required", f"required {missing[0]!r} has no entry in properties, "
                          f"which is the only way it is enforced")
    if "unevaluatedProperties" in node and "additionalProperties" in node:
        raise SchemaError(f"{pointer}/unevaluatedProperties",
                          "unevaluatedProperties beside additionalProperties is not enforced")
    if "format" in node and node["format"] not in FORMATS:
        raise SchemaError(f"{pointer}/format", f"format {node['format']!r} is not enforced (formats "
                          f"enforced: {', '.join(sorted(FORMATS))})")
    for shape in ("pattern", "format"):
        length = next((k for k in ("minLength", "maxLength") if k in node), None)
        if shape in node and length:
            raise SchemaError(f"{pointer}/{length}", f"{length} beside {shape} is not enforced")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
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
