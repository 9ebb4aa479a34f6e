"""The framework adapters on the oldest framework releases pyproject.toml's extras allow.

``openai-agents>=0.2`` and ``langgraph>=0.6`` are claims: `scripts/test-framework-floors`
installs exactly those releases (core dependencies at their newest) and runs this module.
It uses only what those releases have (the main suites, test_openai_agents.py and
test_langgraph.py, use newer APIs: retry settings, the rewind helper, typed graphs); in the
default run it runs on the newest releases too.
"""

from __future__ import annotations

import json
import operator
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict, cast

import pytest
from agents import Agent, ModelResponse, RunConfig, Runner, Usage, function_tool
from agents.items import TResponseInputItem
from agents.models.interface import Model
from langgraph.graph import END, START, StateGraph

import eventstore as es
from adapters.langgraph import ThreadlogCheckpointSaver
from adapters.openai_agents import ThreadlogSession
from tests._sdk_items import call, say

pytestmark = [pytest.mark.anyio, pytest.mark.frameworks]


# -- OpenAI Agents SDK ----------------------------------------------------------------------------


class Scripted(Model):
    """Answers from a script and records each call's input. Takes the model call's arguments
    loosely: releases differ in their keyword-only ones (``conversation_id`` came later)."""

    def __init__(self, steps: list[list[Any]]) -> None:
        self.steps = steps
        self.inputs: list[Any] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        given = args[1] if len(args) > 1 else kwargs["input"]
        self.inputs.append(json.loads(json.dumps(given)))
        return ModelResponse(output=self.steps.pop(0), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")


@function_tool
def weather(city: str) -> str:
    """The weather in a city."""
    return {"Paris": "sunny"}.get(city, "unknown")


def _texts(items: list[TResponseInputItem]) -> list[str]:
    """The text of each message item (user text, assistant output text), in order."""
    out = []
    for item in items:
        entry = cast(dict[str, Any], item)
        content = entry.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [part["text"] for part in content if "text" in part]
    return out


async def test_a_runner_keeps_its_conversation_in_a_threadlog_session(redis_url: str) -> None:
    namespace = "fl" + uuid.uuid4().hex[:10]
    async with await es.connect(redis_url, namespace=namespace) as store:
        model = Scripted(
            [[call("weather", {"city": "Paris"}, 1)], [say("Sunny in Paris.", 2)], [say("Yes.", 3)]]
        )
        agent = Agent(name="forecaster", instructions="Use the tool.", model=model, tools=[weather])
        session = ThreadlogSession("user-1", store)
        config = RunConfig(tracing_disabled=True)
        first = await Runner.run(agent, "Weather in Paris?", session=session, run_config=config)
        assert first.final_output == "Sunny in Paris."
        second = await Runner.run(agent, "Sure?", session=session, run_config=config)
        assert second.final_output == "Yes."
        # The second turn's model call saw the first turn, from the session.
        assert _texts(model.inputs[2]) == ["Weather in Paris?", "Sunny in Paris.", "Sure?"]
        # And a new object over the same store (another process, after a restart) reads it.
        again = ThreadlogSession("user-1", store)
        items = await again.get_items()
        assert _texts(items) == ["Weather in Paris?", "Sunny in Paris.", "Sure?", "Yes."]
        assert any(cast(dict[str, Any], i).get("type") == "function_call" for i in items)
        assert _texts(await again.get_items(limit=1)) == ["Yes."]
        assert _texts([cast(TResponseInputItem, await again.pop_item())]) == ["Yes."]
        await again.clear_session()
        assert await session.get_items() == []


# -- LangGraph ----------------------------------------------------------------------------------


class Counted(TypedDict):
    log: Annotated[list[str], operator.add]


def _step(state: Counted) -> dict[str, list[str]]:
    return {"log": [f"step {len(state['log'])}"]}


async def test_a_graph_resumes_from_threadlog_checkpoints(redis_url: str) -> None:
    namespace = "fl" + uuid.uuid4().hex[:10]
    async with await es.connect(redis_url, namespace=namespace) as store:
        graph = StateGraph(Counted)
        graph.add_node("step", _step)
        graph.add_edge(START, "step")
        graph.add_edge("step", END)
        config: Any = {"configurable": {"thread_id": "chat-1"}}
        app = graph.compile(checkpointer=ThreadlogCheckpointSaver(store))
        assert await app.ainvoke({"log": ["a"]}, config) == {"log": ["a", "step 1"]}
        # A new saver and graph over the same store carry on from the stored checkpoint.
        resumed = graph.compile(checkpointer=ThreadlogCheckpointSaver(store))
        out = await resumed.ainvoke({"log": ["b"]}, config)
        assert out == {"log": ["a", "step 1", "b", "step 3"]}
        assert (await resumed.aget_state(config)).values == out
        saver = ThreadlogCheckpointSaver(store)
        history = [c async for c in saver.alist(config)]
        assert len(history) >= 4  # input and step of each run, newest first
        latest = await saver.aget_tuple(config)
        assert latest is not None and latest.checkpoint["id"] == history[0].checkpoint["id"]
