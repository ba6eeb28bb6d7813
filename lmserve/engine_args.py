"""One command-line flag per ``EngineConfig`` field, generated from the dataclass, so a new
config field shows up on every subcommand that starts an engine without touching the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from collections.abc import Mapping
from typing import (  # noqa: UP035  (Tuple: EngineConfig's spelling, which == must match)
    Any,
    Literal,
    Optional,
    Tuple,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from lmserve.config import EngineConfig

_METAVARS = {int: "N", float: "X", str: "TEXT"}
# Where the type alone says too little about what the flag takes.
_FIELD_METAVARS = {"model": "PATH", "model_lib": "PATH", "opt": "LEVEL[;KNOB=VALUE...]"}


def flag_name(field_name: str) -> str:
    """The flag of an ``EngineConfig`` field: ``max_num_sequence`` -> ``--max-num-sequence``."""
    return "--" + field_name.replace("_", "-")


def _field_docs() -> dict[str, str]:
    """Field name -> its description in the "Fields:" section of EngineConfig's docstring."""
    docs: dict[str, str] = {}
    name = None
    in_fields = False
    for line in inspect.cleandoc(EngineConfig.__doc__ or "").splitlines():
        if line.strip() == "Fields:":
            in_fields = True
        elif in_fields and (m := re.match(r"    (\w+): (.*)", line)):
            name = m.group(1)
            docs[name] = m.group(2)
        elif in_fields and name and line.startswith("        "):
            docs[name] += " " + line.strip()
    return docs


def _model_spec(text: str) -> Union[str, tuple[str, str]]:
    """``PATH`` or ``PATH,MODEL_LIB``: one entry of ``additional_models``."""
    path, sep, lib = text.partition(",")
    return (path, lib) if sep else path


def _flag_kwargs(name: str, hint: Any) -> dict[str, Any]:
    """``add_argument`` keywords for a field with this annotation.

    Raises ``TypeError`` for an annotation it does not know, so a new kind of field fails when
    the parser is built instead of being silently left off the command line.
    """
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union and type(None) in args:
        # Optional[X]: the flag takes an X; leaving it out keeps the default (None).
        (inner,) = (a for a in args if a is not type(None))
        return _flag_kwargs(name, inner)
    if hint is bool:
        return dict(action=argparse.BooleanOptionalAction)
    if origin is Literal:
        return dict(type=type(args[0]), choices=list(args))
    if hint in _METAVARS:
        return dict(type=hint, metavar=_FIELD_METAVARS.get(name, _METAVARS[hint]))
    if origin is list and args[0] == Union[str, Tuple[str, str]]:
        # Both "--x a b" and "--x a --x b" add to the list.
        return dict(type=_model_spec, action="extend", nargs="+", metavar="PATH[,MODEL_LIB]")
    raise TypeError(f"EngineConfig.{name}: no command-line flag for annotation {hint!r}")


def add_engine_args(parser: argparse.ArgumentParser,
                    defaults: Optional[Mapping[str, Any]] = None) -> None:
    """Add one flag per ``EngineConfig`` field to ``parser``, in an "engine" group.

    ``--max-num-sequence`` sets ``max_num_sequence`` and so on; booleans get ``--x/--no-x``,
    and ``--additional-models`` may be repeated. A flag left out keeps the field's default, or
    the one ``defaults`` gives for it (a subcommand's own choice, e.g. a quiet chat). Values are
    only type-checked here; ``engine_config_from_args`` runs EngineConfig's own checks.
    """
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"defaults for unknown EngineConfig fields: {', '.join(sorted(unknown))}")
    group = parser.add_argument_group("engine", "how the engine is set up (EngineConfig)")
    hints = get_type_hints(EngineConfig)
    docs = _field_docs()
    for field in dataclasses.fields(EngineConfig):
        if field.name in defaults:
            default = defaults[field.name]
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = field.default
        # The field docs already say what None means.
        shown = "" if default is None else f" (default: {default!r})"
        group.add_argument(flag_name(field.name), dest=field.name, default=default,
                           help=(docs.get(field.name, "") + shown).strip(),
                           **_flag_kwargs(field.name, hints[field.name]))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags of ``add_engine_args`` describe.

    Raises ``ValueError`` when EngineConfig refuses the values; the message starts with
    ``argument --flag:`` for the flag at fault, as argparse's own errors do, so a caller can
    hand it to ``parser.error``.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    try:
        return EngineConfig(**values)
    except (TypeError, ValueError) as err:
        # EngineConfig's messages start with the field at fault ("max_num_sequence must be..",
        # "opt: unknown level..", "attention_sink_size=3 needs..").
        match = re.match(r"\w*", str(err))
        assert match is not None  # \w* matches the empty string
        first_word = match.group()
        where = f"argument {flag_name(first_word)}: " if first_word in values else ""
        raise ValueError(f"{where}{err}") from err
