"""Model output items for scripted OpenAI Agents SDK runs (the SDK's own types, as a model
returns them). Kept apart from test_openai_agents.py, which needs newer SDK releases than
test_framework_floors.py may have."""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)


def say(text: str, n: int) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg_{n}",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


def call(tool: str, args: dict[str, Any], n: int) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        id=f"fc_{n}",
        call_id=f"call_{n}",
        type="function_call",
        name=tool,
        arguments=json.dumps(args),
        status="completed",
    )
