"""Structured answers: a pydantic model's schema asked of each chat protocol, the answer read back.

``complete(..., response_model=Model)`` asks for an instance of ``Model``:

- OpenAI (Structured Outputs): ``response_format={"type": "json_schema",
  "json_schema": {"name", "schema", "strict": true}}``, as openai-python's
  ``parse()`` sends it. Strict mode accepts a subset of JSON Schema, so the
  schema is made strict by the rules of openai-python's
  ``to_strict_json_schema``: every object closed (``additionalProperties:
  false``), every property required (an optional field stays optional by
  admitting null, as pydantic writes it), ``None`` defaults dropped, a
  one-item ``allOf`` merged, a ``$ref`` beside other keys inlined. The
  answer is the message's content, JSON text.
- Anthropic (Messages API): the documented way to get JSON of a schema is a
  tool whose ``input_schema`` is that schema, forced with ``tool_choice:
  {"type": "tool", "name": ...}``; the answer is that ``tool_use`` block's
  input. It is read back as the text (the input as JSON), the call is taken
  out of ``tool_calls``, and ``finish_reason`` ``tool_calls`` becomes
  ``stop`` when no other call remains: the caller gets what an OpenAI source
  gives. The caller's own ``tools`` stay declared, but the forced tool is the
  one called: a ``tool_choice`` of the caller's is replaced on these sources.

Both get the same strict schema, so an answer has one shape whichever
source served. The schema is built once per model class. ``validate``
checks the answer's text with pydantic's ``model_validate_json``; an answer
that does not validate raises ``ResponseParseError`` (the source is not
blamed: see the chat client), and so does a refusal (OpenAI's
``message.refusal``), named as one rather than read as broken JSON.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, PydanticUserError, ValidationError

from polygateway.errors import RequestRejected, ResponseParseError
from polygateway.models import Choice
from polygateway.transport.openai import ParsedChat

if TYPE_CHECKING:
    from polygateway.models import ChatResponse

__all__ = ["AnswerFormat", "answer_format", "strict_json_schema"]

_NAME_MAX = 64
"""The longest schema (OpenAI) and tool (Anthropic) name both APIs accept."""


@dataclass(frozen=True, slots=True)
class AnswerFormat:
    """What one ``response_model`` asks of each protocol, and how its answer is read back.

    Shared by every call with the same model: nothing here is mutated after it is built.
    """

    model: type[BaseModel]
    schema: dict[str, Any]
    """The model's JSON schema, made strict (``strict_json_schema``)."""
    name: str
    """The schema's name (OpenAI) and the forced tool's (Anthropic): ``[A-Za-z0-9_-]{1,64}``."""
    response_format: dict[str, Any]
    """OpenAI's ``response_format`` parameter."""
    tool: dict[str, Any]
    """The Anthropic tool (in the Messages API's own shape) that carries the schema."""

    def params(self, protocol: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """The call's parameters with the request for this answer added, for ``protocol``."""
        if protocol == "anthropic":
            tools = params.get("tools") or ()
            return {
                **params,
                "tools": [*tools, self.tool],
                "tool_choice": {"type": "tool", "name": self.name},
            }
        return {**params, "response_format": self.response_format}

    def read(self, protocol: str, parsed: ParsedChat) -> ParsedChat:
        """The answer as an OpenAI source gives it: for Anthropic, the forced tool's input as text.

        An answer without the forced call is returned as is: its text fails validation.
        """
        if protocol != "anthropic":
            return parsed
        answer = next((call for call in parsed.tool_calls if call.name == self.name), None)
        if answer is None:
            return parsed
        others = tuple(call for call in parsed.tool_calls if call is not answer)
        finish = parsed.finish_reason
        if finish == "tool_calls" and not others:
            finish = "stop"
        return ParsedChat(
            text=answer.arguments,
            finish_reason=finish,
            tool_calls=others,
            usage=parsed.usage,
            raw=parsed.raw,
            choices=(Choice(0, answer.arguments, others, finish, parsed.refusal),),
            refusal=parsed.refusal,
        )

    def validate(self, response: ChatResponse[None], *, op_name: str, scope: str) -> Any:
        """The answer's text as an instance of the model, or ``ResponseParseError``.

        A refusal (``response.refusal``) is the model declining, not JSON that
        failed: it is raised as such, without validating the empty text, so the
        message says the model refused rather than that the JSON ended early.
        It is still a ``ResponseParseError`` (``r.parsed`` is typed as the
        model, so no response without one is returned), with no errors and the
        refusal on ``.response.refusal``.

        Raises:
            ResponseParseError: the model refused, or the text is not JSON of
                the model's shape; it carries the text, pydantic's errors (none
                for a refusal) and ``response``.
        """
        if response.refusal is not None:
            # The refusal stays out of the message, as the answer does below.
            raise ResponseParseError(
                f"{op_name}: the model refused to answer as a {self.model.__name__} "
                f"at {response.source} (its refusal is on .response.refusal)",
                text=response.text,
                errors=(),
                response=response,
                scope=scope,
                sources=(response.source,),
            )
        try:
            return self.model.model_validate_json(response.text)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            # Place and kind only: the answer itself (the errors' "input") stays out of messages.
            detail = "invalid"
            if errors:
                detail = errors[0]["msg"]
                if errors[0]["loc"]:
                    detail += " at " + ".".join(str(part) for part in errors[0]["loc"])
            raise ResponseParseError(
                f"{op_name}: the answer from {response.source} is not a valid "
                f"{self.model.__name__} ({len(errors)} errors; first: {detail})",
                text=response.text,
                errors=errors,
                response=response,
                scope=scope,
                sources=(response.source,),
            ) from exc


def answer_format(model: object, params: Mapping[str, Any], scope: str) -> AnswerFormat:
    """The format of ``model``'s answers, checked against the call's other parameters.

    Raises:
        RequestRejected: ``model`` is not a pydantic model class or has no
            JSON schema of an object (both APIs want one), or the call also
            sets ``response_format`` (the answer's shape asked twice).
    """
    if not isinstance(model, type) or not issubclass(model, BaseModel):
        raise RequestRejected(
            f"response_model must be a pydantic model class, not {model!r}", scope=scope
        )
    if params.get("response_format") is not None:
        raise RequestRejected(
            "response_model and response_format both ask for the answer's shape: give one",
            scope=scope,
        )
    try:
        built = _format_of(model)
    except (PydanticUserError, ValueError) as exc:
        raise RequestRejected(
            f"response_model {model.__name__} has no JSON schema: {exc}", scope=scope
        ) from exc
    if built.schema.get("type") != "object":
        raise RequestRejected(
            f"response_model {model.__name__} is not a model of fields "
            "(its JSON schema is not an object, which both APIs want)",
            scope=scope,
        )
    return built


@functools.lru_cache(maxsize=256)
def _format_of(model: type[BaseModel]) -> AnswerFormat:
    """Built once per model class: generating and rewriting a schema costs tens of microseconds."""
    schema = strict_json_schema(model.model_json_schema())
    name = re.sub(r"[^A-Za-z0-9_-]", "_", model.__name__)[:_NAME_MAX] or "answer"
    return AnswerFormat(
        model=model,
        schema=schema,
        name=name,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        tool={
            "name": name,
            "description": f"Give the answer as a {name} object, exactly as this schema says.",
            "input_schema": schema,
        },
    )


def strict_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` in the strict form OpenAI's Structured Outputs accept.

    The rules of openai-python's ``to_strict_json_schema`` (module docstring),
    applied through ``$defs``, properties, items, ``prefixItems``, ``anyOf``
    and ``allOf``.
    """
    root = copy.deepcopy(schema)
    strict: dict[str, Any] = _strict(root, root)
    return strict


def _strict(node: Any, root: dict[str, Any]) -> Any:
    """``node`` made strict in place (or, for a ``$ref`` beside other keys, a merged copy)."""
    if not isinstance(node, dict):
        return node
    for key in ("$defs", "definitions"):
        defs = node.get(key)
        if isinstance(defs, dict):
            for name in defs:
                defs[name] = _strict(defs[name], root)
    if node.get("type") == "object" and "additionalProperties" not in node:
        node["additionalProperties"] = False
    properties = node.get("properties")
    if isinstance(properties, dict):
        node["required"] = list(properties)
        node["properties"] = {key: _strict(value, root) for key, value in properties.items()}
    if isinstance(node.get("items"), dict):
        node["items"] = _strict(node["items"], root)
    for key in ("prefixItems", "anyOf"):
        if isinstance(node.get(key), list):
            node[key] = [_strict(item, root) for item in node[key]]
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        if len(all_of) == 1:
            node.pop("allOf")
            node.update(_strict(all_of[0], root))
        else:
            node["allOf"] = [_strict(item, root) for item in all_of]
    if "default" in node and node["default"] is None:
        # Null is admitted by the field's type already; a null default says nothing more.
        del node["default"]
    ref = node.get("$ref")
    if isinstance(ref, str) and len(node) > 1:
        # Strict mode refuses keys beside a $ref (pydantic writes a description there).
        merged = {**_resolve(root, ref), **node}
        del merged["$ref"]
        return _strict(merged, root)
    return node


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    """The schema a local ``$ref`` (``#/$defs/Name``) points at."""
    if not ref.startswith("#/"):
        raise ValueError(f"cannot resolve the schema reference {ref!r}")
    target: Any = root
    for part in ref[2:].split("/"):
        target = target[part]
    if not isinstance(target, dict):
        raise ValueError(f"the schema reference {ref!r} is not an object")
    return target
