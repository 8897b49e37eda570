"""The argument parser: global options, one sub-command per verb, help texts (docs/cli.md is
generated from it and checked)."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, Callable, NoReturn

from .common import _factor, _port, _positive, _scope_options, _seconds
from .demo import cmd_demo
from .doctor import cmd_doctor
from .mcp import cmd_mcp
from .serve import cmd_serve
from .sharing import cmd_export, cmd_import, cmd_keygen, cmd_pull, cmd_push, cmd_upload
from .verbs import cmd_ask, cmd_delete, cmd_learn, cmd_learn_document, cmd_ls, cmd_recall, cmd_recall_document, cmd_reindex, cmd_search, cmd_show, cmd_solve, cmd_stats, cmd_verify


class UsageError(Exception):
    """The command line itself is wrong (an unknown command or option, a missing or bad argument): one
    line that says what and, for a near miss, which command or option was meant (`main` prints it)."""


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error raises `UsageError` (one line, or one JSON object under
    ``--json``, exit 2) instead of printing the usage and exiting, and names the nearest command or
    option for a typo (``graftmem lern`` -> did you mean 'learn'?)."""

    #: every option string of every command, for suggestions (set by `build_parser`)
    known_options: list[str] = []
    #: the commands each option belongs to: a right option on the wrong command is named as such
    option_commands: dict[str, list[str]] = {}
    #: where a command without the option gets its value instead
    INSTEAD = {"--api-key": "the other commands read $GRAFTMEM_API_KEY",
               "--token": "the other commands read $GRAFTMEM_PUSH_TOKEN"}

    def error(self, message: str) -> NoReturn:
        hint = ""
        if (m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)):
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.5)
            message = f"{message.split(':')[0]}: unknown {'command' if 'COMMAND' in message else 'value'} " \
                      f"{m.group(1)!r}" + (f"; did you mean {close[0]!r}?" if close else
                                            f" (choose from {', '.join(choices)})")
        elif (m := re.search(r"unrecognized arguments: (\S+)", message)):
            wrong = m.group(1).split("=")[0]
            owners = self.option_commands.get(wrong)
            if owners:  # not a typo: an option of other commands (it suggested the option itself)
                hint = f"; {wrong} is an option of {', '.join(owners)} only" + (
                    f" ({self.INSTEAD[wrong]})" if wrong in self.INSTEAD else "")
            elif (close := difflib.get_close_matches(wrong, self.known_options, n=1, cutoff=0.6)):
                hint = f"; did you mean {close[0]!r}?"
        raise UsageError(f"{self.prog}: {message}{hint} (see `{self.prog} --help`)")


def _sampling_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--temperature", type=float, default=0.0,
                    help="0 decodes greedily (the mode exactness is proved in); above 0 samples")
    sp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass")
    sp.add_argument("--seed", type=int, default=None, help="seed of the sampler, for a reproducible answer")
    sp.add_argument("--stop", action="append", default=None, metavar="TEXT",
                    help="end the answer at this string (cut from it); repeat for several")
    sp.add_argument("--stream", action="store_true",
                    help="print the answer as it is decoded (ignored with --json)")


class _HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and action.default not in (None, False, argparse.SUPPRESS)
                and action.option_strings and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _global_options(p: argparse.ArgumentParser, default: Any) -> None:
    def d(value: Any) -> Any:
        return argparse.SUPPRESS if default is argparse.SUPPRESS else value

    p.add_argument("--home", default=d(None), help="store directory (default: $GRAFTMEM_HOME or the user data dir)")
    p.add_argument("--store", default=d(None), metavar="URL",
                   help="s3://bucket/prefix: a fleet store in S3-compatible object storage (endpoint and "
                        "credentials from the AWS_* variables; docs/fleet.md), or a directory "
                        "(default: $GRAFTMEM_STORE, else --home)")
    p.add_argument("--model", default=d(None), help="model short name (smollm2, gemma3-270m) or GGUF path "
                                                    "(default: smollm2)")
    p.add_argument("--config", default=d(None), help='engine config as JSON, e.g. \'{"n_ctx": 4096}\'')
    p.add_argument("--json", action="store_true", default=d(False), help="print machine-readable JSON")
    p.add_argument("--url", dest="server_url", default=d(None), metavar="URL",
                   help="search, recall, ask and ls through a running `graftmem serve` (or $GRAFTMEM_URL): "
                        "milliseconds instead of loading the model and the router")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__  # the facade's (defined at the bottom layer, imported by nothing heavy)

    p = _Parser(prog="graftmem", description="Agent memory made of verified, byte-exact KV-cache blocks.",
                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"graftmem {__version__}")
    _global_options(p, None)
    # the same options after the subcommand (`graftmem ls --json`): SUPPRESS keeps a value given before it
    after = _Parser(add_help=False)
    _global_options(after, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[after], formatter_class=_HelpFormatter)
        sp.set_defaults(func=fn)
        return sp

    sp = add("learn", cmd_learn, "learn a text file (or - for stdin) into a block")
    sp.add_argument("file")
    sp.add_argument("--name")
    sp.add_argument("--kind", default="manual")
    sp.add_argument("--when-to-use", default=None, help="which tasks this block serves (embedded for routing)")
    sp.add_argument("--chat", action="store_true", help="store the text as a chat turn, for recall")
    sp.add_argument("--parent", metavar="ID", default=None,
                    help="chain the text on this block (graft it, continue after it; stored as a delta)")
    sp.add_argument("-q", "--quiet", action="store_true",
                    help="print only the block's full id, no progress bar (for scripts: ID=$(graftmem learn f.txt -q))")
    _scope_options(sp, "record that this scope learned the block")
    sp = add("ls", cmd_ls, "list the blocks in the store (with the engine settings they graft under)")
    sp.add_argument("--kind")
    _scope_options(sp, "only the blocks learned in this scope")
    sp = add("show", cmd_show, "show one block's manifest")
    sp.add_argument("id")
    _scope_options(sp, "only if the block was learned in this scope")
    sp = add("ask", cmd_ask, "graft a block and answer a question after it (exit 1 on an empty answer)")
    sp.add_argument("id")
    sp.add_argument("question")
    sp.add_argument("--max-tokens", type=_positive, default=64)
    sp.add_argument("--raw", action="store_true",
                    help="prefill the question as given, even after a chat block (default: as the next user turn)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="graft the block even if its provenance is unverified (see docs/security.md)")
    _scope_options(sp, "only if the block was learned in this scope")
    _sampling_options(sp)
    sp = add("verify", cmd_verify, "prove graft == fresh prefill, byte for byte (exit 1 on any mismatch)")
    sp.add_argument("id")
    sp.add_argument("--samples", type=_positive, default=50)
    sp.add_argument("--no-cross-process", action="store_true", help="skip the graft in a new process")
    sp.add_argument("--rederive", action="store_true",
                    help="instead: re-prefill the block's stored tokens and compare the state bytes")
    sp = add("recall", cmd_recall, "route a task to one block, graft it and answer (exit 1 if nothing matched)")
    sp.add_argument("task")
    sp.add_argument("--max-tokens", type=_positive, default=64)
    sp.add_argument("--min-score", type=float, default=None, help="refuse to graft below this routing score (default: the router's threshold, docs/routing.md)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="graft the routed block even if its provenance is unverified")
    _scope_options(sp, "route among the blocks learned in this scope only")
    _sampling_options(sp)
    sp = add("search", cmd_search, "rank the blocks for a task without grafting anything")
    sp.add_argument("task")
    sp.add_argument("--top-k", type=_positive, default=5)
    _scope_options(sp, "rank the blocks learned in this scope only")
    add("reindex", cmd_reindex, "rebuild the routing index from the store")
    sp = add("learn-document", cmd_learn_document,
             "learn a long text file as pages that fit the window (resumable; exit 1 if incomplete)")
    sp.add_argument("file")
    sp.add_argument("--document", default=None, help="document id (default: a hash of the text)")
    sp.add_argument("--name", default=None)
    sp.add_argument("--window", type=int, default=None, help="page size in tokens (default: n_ctx - 256)")
    sp.add_argument("--overlap", type=int, default=None, help="tokens repeated between pages (default 64)")
    sp = add("recall-document", cmd_recall_document,
             "route a question to one page of a learned document, graft only that page and answer")
    sp.add_argument("task")
    sp.add_argument("--prompt", default=None, help="what to prefill after the page (default: a blank line + task)")
    sp.add_argument("--document", default=None, help="only this document's pages")
    sp.add_argument("--max-tokens", type=_positive, default=32)
    sp.add_argument("--min-score", type=float, default=None, help="refuse to graft below this routing score (default: the router's threshold, docs/routing.md)")
    sp = add("delete", cmd_delete, "delete a block (refused for a block with chained children unless --cascade), "
                                   "or with a scope and no id forget every block of that scope")
    sp.add_argument("id", nargs="?", default=None,
                    help="the block (id or unique prefix); without it, the scope's blocks: those no other scope "
                         "learned are deleted, the others stay theirs")
    _scope_options(sp, "only a block learned in this scope; without an id, all of them")
    sp.add_argument("--cascade", action="store_true", help="also delete every block chained on it")
    add("stats", cmd_stats, "store totals")
    sp = add("solve", cmd_solve, "answer a problem from a verified block, by transfer or live; deposit what "
                                 "the verifier accepts (exit 1 if unsolved)")
    sp.add_argument("problem")
    sp.add_argument("--answer", help="the known answer (verify by exact match); without it the method must "
                                     "reproduce the answer")
    sp.add_argument("--program", help="a Python file printing the answer, used as the solver (run sandboxed)")
    sp.add_argument("--budget", type=int, default=512, help="tokens the model may decode live")
    sp.add_argument("--no-gate", action="store_true", help="use a routed block even if the model is confident")

    def trust_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--incompatible", choices=["refuse", "keep-apart", "skip"], default="refuse",
                        help="blocks made by another engine: refuse all (default), keep them apart "
                             "in <home>/foreign, or leave them out")
        sp.add_argument("--require-signature", action="store_true",
                        help="refuse unsigned bundles and keys not trusted (also: trust.json in the home)")
        sp.add_argument("--trust", action="append", metavar="KEY.pub", help="trust this public key")
        sp.add_argument("--rederive", action=argparse.BooleanOptionalAction, default=True,
                        help="re-prefill each new unsigned block here and refuse unless the state is equal "
                             "(default); --no-rederive lands them unverified (never grafted without "
                             "--allow-unverified, never routed)")

    sp = add("upload", cmd_upload, "copy every block of a local store into the fleet store of --store s3://... "
                                   "(create-once: blocks already there are skipped)")
    sp.add_argument("source", help="the local store directory (a home)")
    sp = add("export", cmd_export, "write blocks (default all) to one bundle file")
    sp.add_argument("path")
    sp.add_argument("ids", nargs="*", help="block ids or prefixes (default: all)")
    sp.add_argument("--kind")
    sp.add_argument("--sign", metavar="KEY", help="sign the bundle with this private key")
    sp = add("import", cmd_import, "import a bundle: every digest checked, all or nothing")
    sp.add_argument("path")
    trust_args(sp)
    sp = add("serve", cmd_serve, "one long-running server: the OpenAI-compatible API with a persistent, "
             "verified prompt cache, and block sharing (read-only unless a push token is set)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--api-key", help="require this key on every request (or $GRAFTMEM_API_KEY): one trust domain")
    sp.add_argument("--api-key-file", metavar="PATH",
                    help="one tenant per line, 'NAME sha256:<hex of the key>': each key's tenant gets its own "
                         "prompt cache, automatic blocks and receipts (docs/security.md)")
    sp.add_argument("--metrics-key",
                    help="the operator's key (or $GRAFTMEM_METRICS_KEY): it reads /metrics and /v1/info only, "
                         "the whole server's; with --api-key-file a tenant's key reads its own counters")
    sp.add_argument("--shared-learned", action="store_true",
                    help="with --api-key-file: blocks a tenant learns through REST are shared with every tenant "
                         "unless it sends \"shared\": false (default: its own unless it sends \"shared\": true)")
    sp.add_argument("--ui", action="store_true",
                    help="serve the web page /ui: the blocks, chains, conversations, verify, router hits and "
                         "metrics, behind the same API keys (docs/ui.md)")
    sp.add_argument("--blocks-only", action="store_true",
                    help="serve block sharing only: no model is loaded, no OpenAI API")
    sp.add_argument("--engines", type=int, default=1, help="engine contexts (requests decoded at once)")
    sp.add_argument("--max-queue", type=int, default=16, help="requests that may wait; more get 429")
    sp.add_argument("--min-prefix-tokens", type=int, default=256,
                    help="learn a prompt prefix (up to the last message) of at least this many tokens...")
    sp.add_argument("--sightings", type=int, default=2, help="...once it has been seen this many times")
    sp.add_argument("--no-learn", action="store_true", help="graft stored prefixes but learn no new ones")
    sp.add_argument("--max-auto-mb", type=int, default=2048,
                    help="keep automatic prefix blocks under this many MB (least recently used evicted first; "
                         "blocks you learned are never evicted)")
    sp.add_argument("--auto-storage", choices=("full", "delta"), default="full",
                    help="store automatic chained blocks whole (fast grafts) or as deltas over their parent (less disk)")
    sp.add_argument("--responses-ttl", type=float, default=30 * 24 * 3600, metavar="SECONDS",
                    help="delete a stored response (/v1/responses, store: true) this long after it was created "
                         "(it counts in --max-auto-mb meanwhile; 0: keep none past the request)")
    sp.add_argument("--no-warm", action="store_true",
                    help="start with empty engines instead of grafting the most recently learned prompt prefixes")
    sp.add_argument("--chat-template-file", metavar="FILE",
                    help="render chat requests with this Jinja template instead of the GGUF's own (docs/models.md)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="graft blocks nothing here vouches for (imported with --no-rederive, dropped into the "
                         "store) for every request and the warm start; without it only a request that sends "
                         "graftmem.allow_unverified gets them, and receipts name the provenance")
    sp.add_argument("--port", type=_port, default=8765, help="0 picks a free port")
    sp.add_argument("--max-connections", type=_positive, metavar="N",
                    help="open connections at most; past it idle or stalled ones (slow bodies, unread answers) are closed "
                         "(default: a quarter of the process's file-descriptor limit, at most 1000)")
    sp.add_argument("--max-connections-per-client", type=_positive, metavar="N",
                    help="open connections one client address may hold (default: half of --max-connections; "
                         "every local agent on 127.0.0.1 is one address)")
    sp.add_argument("--min-body-rate", type=_positive, default=1024, metavar="BYTES_PER_S",
                    help="a request body must arrive at this rate at least (408 once --body-grace behind it)")
    sp.add_argument("--body-grace", type=_seconds, default=10.0, metavar="SECONDS",
                    help="seconds a body may fall behind --min-body-rate")
    sp.add_argument("--write-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                    help="close a connection whose client reads nothing of its answer for this long")
    sp.add_argument("--max-embedding-inputs", type=_positive, default=2048, metavar="N",
                    help="texts one /v1/embeddings request may embed")
    sp.add_argument("--max-embedding-chars", type=_positive, default=256 << 10, metavar="N",
                    help="characters of all the texts of one /v1/embeddings request together")
    sp.add_argument("--render-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                    help="seconds a request's prompt may take to render and tokenize (and its schema to become a "
                         "grammar); past it the work is stopped and the request is a 400")
    sp.add_argument("--preload-router", action="store_true",
                    help="load the router and its embedder before serving (seconds, ~0.5 GB), not on the first "
                         "request that routes or embeds, which would stall the others while it loads")
    sp.add_argument("--refusal-delay", type=_factor, default=3.0, metavar="FACTOR",
                    help="hold a refused request's answer (400/401/403/413/422/431) FACTOR times as long as it took "
                         "to refuse, at most 2 s, so that one client looping on refused requests cannot take a core "
                         "from the others (0: answer at once)")
    sp.add_argument("--max-messages", type=_positive, default=4096, metavar="N",
                    help="messages one chat request may hold (lowered to the model's context)")
    sp.add_argument("--max-schema-repeat", type=_positive, default=500, metavar="N",
                    help="the largest minLength/maxLength/minItems/maxItems or pattern {m,n} a response_format or "
                         "forced tool schema may ask for (a grammar unrolls each)")
    sp.add_argument("--max-enum-values", type=_positive, default=1000, metavar="N",
                    help="enum/const values one response_format or forced tool schema may hold")
    sp.add_argument("--mcp", action="store_true",
                    help="also answer MCP (streamable HTTP) at /mcp, behind the same keys and tenants "
                         "(needs graftmem[mcp]; docs/integrations/mcp.md)")
    sp.add_argument("--push-token", help="accept pushes with this token (or $GRAFTMEM_PUSH_TOKEN)")
    sp.add_argument("--sign", metavar="KEY", help="sign listings with this private key")
    sp.add_argument("--rederive", action=argparse.BooleanOptionalAction, default=True,
                    help="re-prefill every pushed block not signed by a trusted key and refuse it unless "
                         "the state is equal (default); --no-rederive lands them unverified")
    add("mcp", cmd_mcp, "an MCP server over stdin/stdout (for Claude Desktop, Cursor, agent frameworks): the "
        "memory's verbs as tools, its blocks as resources; through --url's server, else this store's model "
        "(needs graftmem[mcp]; docs/integrations/mcp.md)")
    sp = add("pull", cmd_pull, "copy blocks from a graftmem server, checked as they arrive, resumable")
    sp.add_argument("url")
    sp.add_argument("ids", nargs="*", help="block ids or prefixes (default: all)")
    sp.add_argument("--kind")
    sp.add_argument("--api-key", help="the server's API key, if it has one (or $GRAFTMEM_API_KEY); with "
                    "tenants: that tenant's blocks and the shared ones")
    trust_args(sp)
    sp = add("push", cmd_push, "send blocks to a graftmem server that accepts pushes")
    sp.add_argument("url")
    sp.add_argument("ids", nargs="*", help="block ids or prefixes (default: all)")
    sp.add_argument("--kind")
    sp.add_argument("--token", help="the server's push token (or $GRAFTMEM_PUSH_TOKEN)")
    sp.add_argument("--sign", metavar="KEY", help="sign the pushed bundle with this private key")
    sp = add("keygen", cmd_keygen, "make an ed25519 key pair for signing bundles (PATH and PATH.pub)")
    sp.add_argument("path")
    sp = add("doctor", cmd_doctor, "model, fingerprint, exactness probe, store location and health")
    sp.add_argument("--check-bytes", action="store_true",
                    help="also read every block's state and check its BLAKE3 digest (as long as reading the "
                    "whole store; without it: headers, manifests and trailers)")
    sp = add("demo", cmd_demo, "learn, recall and verify on the default model (the README's first command)")
    sp.add_argument("--samples", type=_positive, default=20)
    for sp in sub.choices.values():  # options without a help text still show their default
        for action in sp._actions:
            if action.help is None and action.option_strings and action.default not in (None, False):
                action.help = "(default: %(default)s)"
    p.known_options = sorted({o for sp in [p, *sub.choices.values()] for a in sp._actions
                                    for o in a.option_strings})
    owners: dict[str, list[str]] = {}
    for name, sp in sub.choices.items():
        for a in sp._actions:
            for o in a.option_strings:
                owners.setdefault(o, []).append(name)
    p.option_commands = {o: cmds for o, cmds in owners.items() if len(cmds) < len(sub.choices)}
    return p
