"""The one constraint resolver: the request fields that constrain what a request generates,
merged once into one ``StructuredOutputsParams``.

The fields: OpenAI's ``response_format`` (``json_object``, ``json_schema``; vLLM's
``structural_tag``), vLLM's ``structured_outputs`` object, its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` spellings, and on chat a
``tool_choice`` of ``required`` or a named function (whose JSON schema serve/tool_choice.py
builds).  At most one of them may be set: two are a 400 naming both (never one silently
replacing the other).  Whether the constraint compiles is the input processor's check, whose
error names ``structured_outputs`` and is reported under the field the client actually sent
(:attr:`Constraint.field`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.config import BACKENDS
from serve.protocol import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older per-kind fields -> the StructuredOutputsParams field each sets."""

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """A request's resolved constraint."""

    field: str | None
    """The request field it came from (None: unconstrained)."""
    params: StructuredOutputsParams | None

    def error_aliases(self) -> dict[str, str]:
        """The engine's ``structured_outputs`` errors reported under the field the client sent."""
        return {"structured_outputs": self.field} if self.field else {}


def constraint_field(req, tool_constrained: bool = False) -> str | None:
    """The one constraint field the request sets (None: unconstrained); a 400 naming both
    fields when it sets several.  ``tool_constrained``: the chat request's ``tool_choice`` is
    ``required`` or a named function, which is a constraint too."""
    sent = ["tool_choice"] if tool_constrained else []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type", "text") != "text":
        sent.append("response_format")
    if getattr(req, "structured_outputs", None) is not None:
        sent.append("structured_outputs")
    sent += [name for name in GUIDED if getattr(req, name, None) is not None]
    if len(sent) > 1:
        raise bad_request(f"only one kind of constraint may be given per request, got both {sent[0]} and {sent[1]}"
                          + (f" (and {', '.join(sent[2:])})" if len(sent) > 2 else "")
                          + ("; a tool_choice of \"required\" or a named function already constrains the output "
                             "to the tools' JSON" if sent[0] == "tool_choice" else ""), sent[1])
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None and backend not in (*BACKENDS, "llguidance"):
        raise bad_request(f"guided_decoding_backend {backend!r} is not available; this server has "
                          f"{', '.join(BACKENDS)}", "guided_decoding_backend")
    return sent[0] if sent else None


def _response_format(rf: dict) -> StructuredOutputsParams:
    kind = rf.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(f"response_format: unknown type {kind!r}; expected one of {', '.join(RESPONSE_FORMATS)}",
                          "response_format")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=tag)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format: type json_schema needs a json_schema object "
                          "({\"name\": ..., \"schema\": ...})", "response_format")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise bad_request("response_format.json_schema: 'schema' is missing", "response_format")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON object", "response_format")
    return StructuredOutputsParams(json=schema)


def resolve_constraint(req, tool_schema: dict | None = None) -> Constraint:
    """The request's constraint (see the module docstring), resolved once; a 400 naming the
    field when it is malformed before compiling, or both fields when two are set.
    ``tool_schema``: the JSON schema a chat ``tool_choice`` of ``required`` / a named function
    imposes (serve/tool_choice.py:tool_choice_schema), else None."""
    field = constraint_field(req, tool_schema is not None)
    if field is None:
        return Constraint(None, None)
    if field == "tool_choice":
        return Constraint(field, StructuredOutputsParams(json=tool_schema))
    return Constraint(field, _structured_outputs(req, field))


def _structured_outputs(req, field: str) -> StructuredOutputsParams:
    try:
        if field == "response_format":
            return _response_format(req.response_format)
        if field == "structured_outputs":
            so = req.structured_outputs
            if not isinstance(so, dict):
                raise bad_request("structured_outputs must be a JSON object", field)
            known = set(StructuredOutputsParams.__dataclass_fields__) - {"_KINDS"}
            unknown = sorted(set(so) - known)
            if unknown:
                raise bad_request(f"structured_outputs: unknown field(s) {unknown}", field)
            return StructuredOutputsParams(**so)
        value = getattr(req, field)
        extra = {}
        if field == "guided_json" and getattr(req, "guided_whitespace_pattern", None) is not None:
            extra["whitespace_pattern"] = req.guided_whitespace_pattern
        return StructuredOutputsParams(**{GUIDED[field]: value}, **extra)
    except (ValueError, TypeError) as e:
        msg = str(e).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(e)
        raise bad_request(msg, field) from None
