"""What the output must match: OpenAI's `response_format` and vLLM's `structured_outputs`
(a JSON schema, any JSON object, a regex, a choice or a Lark grammar)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pdcluster.cluster.api.messages import OpenAIBody, invalid
from pdcluster.engine.sampling_params import StructuredOutputsParams


class TextFormat(OpenAIBody):
    type: Literal["text"]


class JSONObjectFormat(OpenAIBody):
    type: Literal["json_object"]


class JSONSchema(OpenAIBody):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the schema's name")
    description: str | None = Field(None, description="what the output is for")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON schema the output matches; absent: any JSON"
    )
    strict: bool | None = Field(None, description="accepted: the output always follows the schema")


class JSONSchemaFormat(OpenAIBody):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class StructuredOutputs(OpenAIBody):
    """vLLM's `structured_outputs`: exactly one grammar the output must match."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema (an object, or its text)"
    )
    regex: str | None = Field(None, min_length=1, description="a regular expression")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=1024, description="the output is one of these strings"
    )
    grammar: str | None = Field(None, min_length=1, description="a Lark grammar")
    json_object: bool | None = Field(None, description="true: any JSON object")

    @model_validator(mode="after")
    def _one_grammar(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise invalid(
                "structured_outputs: give exactly one of json, regex, choice, grammar and "
                f"json_object (got {', '.join(g.rstrip('_') for g in given) or 'none'})"
            )
        return self

    def params(self) -> StructuredOutputsParams:
        schema = self.json_
        return StructuredOutputsParams(
            json=json.dumps(schema) if isinstance(schema, dict) else schema,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=tuple(self.choice) if self.choice is not None else None,
            grammar=self.grammar,
        )
