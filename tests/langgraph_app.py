"""A LangGraph app on graftmem, one turn per process (tests/test_integrations_langgraph.py runs it twice:
the second run is the restarted app): its thread in a `GraftmemCheckpointer` file, its memories in a
`GraftmemStore`, its model ``ChatOpenAI`` on graftmem's Responses API with ``use_previous_response_id``.

    python tests/langgraph_app.py URL CHECKPOINTS THREAD TEXT   ->  one JSON line: answer, response id, memories
"""

from __future__ import annotations

import json
import sys

from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.store.base import BaseStore

from graftmem.integrations import GraftmemCheckpointer, GraftmemStore


def build(url: str, checkpoints: str):
    llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model="smollm2", temperature=0, max_tokens=12,
                     max_retries=0, use_responses_api=True, use_previous_response_id=True)

    def remember(state: MessagesState, *, store: BaseStore) -> dict:
        turn = sum(1 for m in state["messages"] if m.type == "human")
        store.put(("users", "ana"), f"turn-{turn}", {"text": state["messages"][-1].content})
        return {}

    def chat(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("remember", remember)
    g.add_node("chat", chat)
    g.add_edge(START, "remember")
    g.add_edge("remember", "chat")
    return g.compile(checkpointer=GraftmemCheckpointer(checkpoints, url=url), store=GraftmemStore(url))


if __name__ == "__main__":
    url, checkpoints, thread, text = sys.argv[1:5]
    graph = build(url, checkpoints)
    out = graph.invoke({"messages": [("user", text)]}, {"configurable": {"thread_id": thread}})
    last = out["messages"][-1]
    memories = [i.key for i in graph.store.search(("users", "ana"))]
    line = json.dumps({"answer": last.content if isinstance(last.content, str) else last.text,
                       "response_id": last.response_metadata.get("id"), "messages": len(out["messages"]),
                       "memories": sorted(memories)})
    print(line)  # noqa: T201 - the test reads this line
