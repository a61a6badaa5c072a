"""instructor driven as its users drive it, run by the interpreter of .venv/instructor (requirements-instructor.txt:
it cannot share the test venv) against the server at argv[1]: `Mode.TOOLS` and `Mode.JSON_SCHEMA` on a nested
pydantic model (a list, an enum, an optional field: the schema has `$defs`). Prints each result as JSON, a line per
mode; the test validates them again on its side."""

import json
import sys
from enum import Enum

import instructor
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


# extra="forbid" (additionalProperties: false, what OpenAI's strict mode requires): where the schema allows other
# properties, as JSON Schema does by default, Qwen2.5-Coder 0.5B adds its own ("temperature", then a "description"
# of 60 tokens and more) and runs out of max_tokens.
class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=20)
    unit: Unit


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")

    places: list[Place] = Field(max_length=2)
    note: str | None = Field(None, max_length=20)


def main(base_url: str, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused"), mode=mode)
        forecast = client.chat.completions.create(
            model=model, response_model=Forecast, messages=ask, max_tokens=80, temperature=0, max_retries=0
        )
        print(json.dumps({"mode": mode.value, "forecast": forecast.model_dump(mode="json")}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
