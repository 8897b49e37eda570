"""pydantic-ai and LangGraph over the server's Chat Completions, unmodified except ``base_url``: a
pydantic-ai agent with a function tool, pydantic-ai agents with a structured ``output_type`` (its
default tool output, which sends ``tool_choice: "required"``, and its native output, which sends
``response_format`` json_schema: both parse and validate every time, on SmolLM2), and LangGraph's
``create_react_agent`` with a tool. SmolLM2-135M may answer poorly; what is checked is the protocol
(no client-side validation error, no 4xx / 5xx) and, where the server enforces it, the output's shape."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from graftmem.server import api_server
from graftmem.store.local import Store

pytest.importorskip("pydantic_ai")


class Customer(BaseModel):
    """A shop's customer."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


def _weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 C."


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("frameworks") / "home")
    with api_server(store, [smol], warm=False) as srv:
        yield srv
    store.close()


def _model(srv):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=srv.url + "/v1", api_key="unused"))


def test_pydantic_ai_agent_with_a_function_tool(server):
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.messages import (ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart,
                                      UserPromptPart)

    calls: list[str] = []

    agent = Agent(_model(server), system_prompt="You answer weather questions. Call get_weather first.",
                  model_settings=ModelSettings(max_tokens=48, temperature=0))

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return _weather(city)

    # two earlier exchanges in the history show the model the call format (what an agent's memory holds);
    # SmolLM2-135M follows it after two
    history = []
    for i, city in enumerate(("Rome", "Oslo")):
        history += [ModelRequest(parts=[UserPromptPart(f"Weather in {city}?")]),
                    ModelResponse(parts=[ToolCallPart("get_weather", {"city": city}, tool_call_id=f"call_{i}")]),
                    ModelRequest(parts=[ToolReturnPart("get_weather", _weather(city), tool_call_id=f"call_{i}")]),
                    ModelResponse(parts=[TextPart(f"It is sunny in {city}, 21 C.")])]
    result = agent.run_sync("Weather in Paris?", message_history=history)
    assert isinstance(result.output, str)
    new = result.new_messages()
    assert new[0].parts[-1].content == "Weather in Paris?"
    returns = [p for m in new for p in m.parts if isinstance(p, ToolReturnPart)]
    assert calls and len(returns) == len(calls)  # the model's call was parsed, run, and its result sent back


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_structured_output_validates_every_time(server, mode):
    """Tool output (pydantic-ai's default: a forced call of its ``final_result`` tool) and native output
    (``response_format`` json_schema): the grammar makes every answer a ``Customer``."""
    from pydantic_ai import Agent, ModelSettings, NativeOutput

    output = Customer if mode == "tool" else NativeOutput(Customer)
    agent = Agent(_model(server), output_type=output, retries=0,
                  model_settings=ModelSettings(max_tokens=64, temperature=0))
    for prompt in ("Ana Silva is 34 and lives in Lisbon.", "Describe a customer.", "Bo Chen, age 51."):
        result = agent.run_sync(prompt)
        assert isinstance(result.output, Customer), result.output
        assert result.usage.requests == 1  # validated at the first answer: no retry was needed


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # the issue asks for this one
def test_langgraph_react_agent_with_a_tool(server):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return _weather(city)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                     max_tokens=48, max_retries=0)
    graph = create_react_agent(llm, [get_weather])
    history = [SystemMessage("Call get_weather for weather questions.")]
    for i, city in enumerate(("Rome", "Oslo")):  # two worked examples: SmolLM2-135M follows the format after two
        history += [HumanMessage(f"Weather in {city}?"),
                    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": city}, "id": f"call_{i}"}]),
                    ToolMessage(_weather(city), tool_call_id=f"call_{i}"),
                    AIMessage(f"It is sunny in {city}, 21 C.")]
    out = graph.invoke({"messages": history + [HumanMessage("Weather in Paris?")]}, {"recursion_limit": 8})
    new = out["messages"][len(history) + 1:]
    assert isinstance(new[-1], AIMessage) and not new[-1].tool_calls
    # the call was parsed into LangChain's tool_calls, run by the graph's tool node, and answered
    assert [type(m).__name__ for m in new] == ["AIMessage", "ToolMessage", "AIMessage"], new
    assert new[0].tool_calls[0]["name"] == "get_weather"
    # a forced call through LangChain's own tool_choice: the call parses into LangChain's tool_calls
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Hello!")
    assert forced.tool_calls and forced.tool_calls[0]["name"] == "get_weather"
    assert isinstance(forced.tool_calls[0]["args"]["city"], str)
