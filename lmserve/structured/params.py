"""What a request asks its output to follow: a JSON schema, any JSON object, a regex, a choice of
strings, an EBNF or Lark grammar, or an xgrammar structural tag (vLLM's ``structured_outputs``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

# The constraint kinds, exactly one of which a StructuredOutputsParams sets (vLLM's names).
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint, named as vLLM's ``StructuredOutputsParams`` names it.

    Exactly one of the constraint fields is set. ``json`` is a JSON schema (a dict, or its JSON
    text); ``json_object`` any JSON object; ``regex`` a regular expression the whole output
    matches; ``choice`` one of the given strings; ``grammar`` an EBNF grammar with a ``root``
    rule (xgrammar's dialect of GBNF) or a Lark grammar with a ``start`` rule; ``structural_tag``
    xgrammar's structural tag, as JSON text.

    ``disable_any_whitespace`` (None: True) keeps JSON compact: one space after ``:`` and ``,``
    and none elsewhere. Allowing any whitespace lets a small model pad its output with newlines
    until ``max_tokens`` cuts it, so lmserve disables it unless asked (vLLM allows it unless
    disabled). ``origin`` names the request field the constraint came from, for error messages.
    """

    json: Union[dict[str, Any], str, None] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: Optional[bool] = None
    origin: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.origin} must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"{self.origin}.choice must be a list of strings, got {self.choice!r}")
            if not self.choice or "" in self.choice:
                raise ValueError(f"{self.origin}.choice must hold at least one string, none empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{self.origin}.{name} must be a non-empty string, got {value!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"{self.origin}.json must be a JSON schema (an object or its JSON text)")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def compact(self) -> bool:
        """Whether JSON output is kept compact (no free whitespace)."""
        return self.disable_any_whitespace is not False

    def schema(self) -> Any:
        """The JSON schema as a Python value (``json`` parsed when given as text).

        Raises ``ValueError`` when the text is not JSON."""
        if isinstance(self.json, str):
            try:
                return json.loads(self.json)
            except json.JSONDecodeError as err:
                raise ValueError(f"{self.origin}.json is not valid JSON: {err}") from None
        return self.json
