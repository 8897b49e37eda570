"""Server: graftmem over HTTP, one Starlette app under uvicorn. `BlockServer` shares a store's
blocks; `api_server()` adds the OpenAI-compatible API (engine pool, persistent prefix cache); `ServeConfig` holds
every option of either. It is
given a store, engines and checks, never a [`Memory`][graftmem.Memory]."""

from .blocks import BlockRoutes, BlockServer
from .config import ServeConfig
from .http import Limits
from .openai import OpenAIRoutes
from .pipeline import RECEIPT_HEADER, ChatPipeline
from .pool import EnginePool, pool_engines
from .prefix import AUTO_KIND, PrefixCache
from .rest import MemoryRoutes
from .service import api_server, bind, block_server
from .tenants import ApiKeys, hash_key
from .tools import AnswerParser, answer_spec, request_tools, split_answer

__all__ = ["AUTO_KIND", "AnswerParser", "ApiKeys", "BlockRoutes", "BlockServer", "ChatPipeline", "EnginePool", "Limits", "MemoryRoutes", "OpenAIRoutes", "PrefixCache",
           "RECEIPT_HEADER", "ServeConfig", "answer_spec", "api_server", "bind", "block_server", "hash_key", "pool_engines", "request_tools",
           "split_answer"]
