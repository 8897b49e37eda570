"""Where agents already live: graftmem's memory behind the interfaces agent frameworks speak.

* `graftmem.integrations.mcp`: an MCP server (the official ``mcp`` SDK): ``graftmem mcp`` over stdio, and
  the streamable-HTTP door ``graftmem serve --mcp`` mounts at ``/mcp`` (extra ``graftmem[mcp]``);
* `graftmem.integrations.langgraph`: a LangGraph ``BaseStore`` whose items are blocks and a checkpointer
  whose threads are stored KV chains (extra ``graftmem[langgraph]``);
* `graftmem.integrations.agents`: an OpenAI Agents SDK ``Session`` backed by stored Responses chains
  (extra ``graftmem[agents]``).

Each talks to graftmem through its public API only (`graftmem.api.RemoteJSON` / `RemoteMemory` against
a ``graftmem serve``, or the server's own routes in-process), so an integration answers what the REST
routes answer, under the same keys and tenants. Names are imported on first use (PEP 562): importing
this package needs none of the third-party SDKs; using a name needs its extra.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agents import GraftmemResponsesModel, GraftmemSession
    from .langgraph import GraftmemCheckpointer, GraftmemStore
    from .mcp import McpDoor, build_mcp_server, run_stdio

_LAZY: dict[str, str] = {
    "GraftmemCheckpointer": ".langgraph",
    "GraftmemStore": ".langgraph",
    "GraftmemResponsesModel": ".agents",
    "GraftmemSession": ".agents",
    "McpDoor": ".mcp",
    "build_mcp_server": ".mcp",
    "run_stdio": ".mcp",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["GraftmemCheckpointer", "GraftmemResponsesModel", "GraftmemStore", "GraftmemSession", "McpDoor", "build_mcp_server", "run_stdio"]
