"""Does an agent framework's tool loop get tool calls from the model? LangGraph's ``create_react_agent``
against ``graftmem serve``'s OpenAI API (in this process), 5 weather questions and one tool, three ways:
the question alone; after two worked examples in the history; a forced call (``tool_choice``). What
docs/agents.md states about agent frameworks is this table (issue 43: "tested" had hidden that the
unforced agent never called its tool on SmolLM2).

    python -m bench.agent_tools [--model smollm2]

Prints the counts and writes bench/results/agent_tools.json (needs the langgraph / langchain-openai
packages of the dev extra).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "agent_tools.json"
CITIES = ("Paris", "Madrid", "Berlin", "Lima", "Cairo")


def _weather(city: str) -> str:
    return f"Sunny in {city}, 21 C."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    from graftmem import Engine, Store
    from graftmem.server import api_server

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return _weather(city)

    result: dict = {"model": args.model, "questions": len(CITIES), "max_tokens": 48}
    with Engine(args.model) as e, api_server(Store(tempfile.mkdtemp()), [e], warm=False) as srv:
        llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model=args.model, temperature=0,
                         max_tokens=48, max_retries=0)
        graph = create_react_agent(llm, [get_weather])

        def called(history: list) -> tuple[bool, str]:
            out = graph.invoke({"messages": history}, {"recursion_limit": 6})
            new = out["messages"][len(history):]
            return any(isinstance(m, AIMessage) and m.tool_calls for m in new), str(out["messages"][-1].content)[:100]

        plain = [called([HumanMessage(f"What is the weather in {c}?")]) for c in CITIES]
        shots = [SystemMessage("Call get_weather for weather questions.")]
        for i, c in enumerate(("Rome", "Oslo")):
            shots += [HumanMessage(f"Weather in {c}?"),
                      AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": c}, "id": f"call_{i}"}]),
                      ToolMessage(_weather(c), tool_call_id=f"call_{i}"), AIMessage(f"It is sunny in {c}, 21 C.")]
        few = [called(shots + [HumanMessage(f"Weather in {c}?")]) for c in CITIES]
        forced = llm.bind_tools([get_weather], tool_choice="get_weather")
        calls = [forced.invoke(f"What is the weather in {c}?").tool_calls for c in CITIES]
    result["unforced_called"] = sum(c for c, _ in plain)
    result["unforced_answers"] = [a for _, a in plain]
    result["two_examples_called"] = sum(c for c, _ in few)
    result["forced_parsed"] = sum(bool(c) for c in calls)
    result["forced_args"] = [c[0]["args"] if c else None for c in calls]
    result["forced_city_as_asked"] = sum(bool(c) and c[0]["args"].get("city") == city for c, city in zip(calls, CITIES))
    for k in ("unforced_called", "two_examples_called", "forced_parsed", "forced_city_as_asked"):
        print(f"{k:22} {result[k]} of {len(CITIES)}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
