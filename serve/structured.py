"""The request fields that constrain what a request generates, as one
``StructuredOutputsParams``: OpenAI's ``response_format`` (``json_object``, ``json_schema``;
vLLM's ``structural_tag``), vLLM's ``structured_outputs`` object and its older ``guided_json``
/ ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` spellings.  At most one of them may
be set; whether the constraint compiles is the input processor's check, whose error names
``structured_outputs`` and is reported under the field the client actually sent
(:func:`constraint_field`)."""

from __future__ import annotations

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.config import BACKENDS

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older per-kind fields -> the StructuredOutputsParams field each sets."""

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _bad(message: str, param: str):
    from serve.protocol import bad_request
    return bad_request(message, param)


def constraint_field(req) -> str | None:
    """The one constraint field the request sets (None: unconstrained); a 400 when it sets several."""
    sent = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type", "text") != "text":
        sent.append("response_format")
    if getattr(req, "structured_outputs", None) is not None:
        sent.append("structured_outputs")
    sent += [name for name in GUIDED if getattr(req, name, None) is not None]
    if len(sent) > 1:
        raise _bad(f"only one kind of structured output may be given per request, got {', '.join(sent)}", sent[1])
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None and backend not in (*BACKENDS, "llguidance"):
        raise _bad(f"guided_decoding_backend {backend!r} is not available; this server has "
                   f"{', '.join(BACKENDS)}", "guided_decoding_backend")
    return sent[0] if sent else None


def _response_format(rf: dict) -> StructuredOutputsParams:
    kind = rf.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise _bad(f"response_format: unknown type {kind!r}; expected one of {', '.join(RESPONSE_FORMATS)}",
                   "response_format")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=tag)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format: type json_schema needs a json_schema object ({\"name\": ..., \"schema\": ...})",
                   "response_format")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise _bad("response_format.json_schema: 'schema' is missing", "response_format")
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON object", "response_format")
    return StructuredOutputsParams(json=schema)


def structured_outputs(req) -> StructuredOutputsParams | None:
    """The request's constraint (see the module docstring); a 400 naming the field when it is
    malformed before compiling."""
    field = constraint_field(req)
    if field is None:
        return None
    try:
        if field == "response_format":
            return _response_format(req.response_format)
        if field == "structured_outputs":
            so = req.structured_outputs
            if not isinstance(so, dict):
                raise _bad("structured_outputs must be a JSON object", field)
            known = set(StructuredOutputsParams.__dataclass_fields__) - {"_KINDS"}
            unknown = sorted(set(so) - known)
            if unknown:
                raise _bad(f"structured_outputs: unknown field(s) {unknown}", field)
            return StructuredOutputsParams(**so)
        value = getattr(req, field)
        extra = {}
        if field == "guided_json" and getattr(req, "guided_whitespace_pattern", None) is not None:
            extra["whitespace_pattern"] = req.guided_whitespace_pattern
        return StructuredOutputsParams(**{GUIDED[field]: value}, **extra)
    except (ValueError, TypeError) as e:
        msg = str(e).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(e)
        raise _bad(msg, field) from None
