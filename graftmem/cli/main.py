"""The entry point: parse, run one command, turn errors into one line and an exit code.

Every error leaves the same way, whatever raised it (a graftmem error, bad input the API did not name,
a mistyped command or option): exit 2 (130 when interrupted) and one line ``error: ...`` on stderr, or
under ``--json`` one object on stdout, so a script that reads the command's JSON reads its errors from
the same stream with the same keys::

    {"error": {"type": "BlockNotFound", "message": "no block 'abcd' in this store",
               "fix": "list the store (graftmem ls) and give an id or a unique prefix of one",
               "exit_code": 2}}

``type`` is the exception's class name (`graftmem.core.errors`; ``UsageError`` for the command line
itself, ``OSError`` / ``ValueError`` for input the API did not name), ``fix`` what to do next for that
kind of error (None where the message is the whole story).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from .parser import UsageError, build_parser

#: What to do next, per kind of error (the first class of the exception's MRO found here): the tree of
#: `graftmem.core.errors`, "grouped by what the caller does next", said as the step a CLI user takes.
#: The message names the object and the specific cause; this is the general remedy beside it.
FIXES: dict[str, str] = {
    "UsageError": "run `graftmem --help` or `graftmem COMMAND --help` for the commands and their options",
    "BlockNotFound": "list the store (`graftmem ls`) and give an id, or a unique prefix of one, that it shows",
    "StoreLocked": "another process holds the store: retry when it is done, or give it another --home",
    "StoreFull": "free disk space and run the command again (nothing was half-written)",
    "StoreReadOnly": "reading works; to learn, give a writable --home (or fix the directory's permissions)",
    "StoreError": "check the --home / --store named in the message",
    "IncompatibleBlock": "run with the same --model and --config the block was learned with "
                         "(`graftmem show ID` prints them), or learn the text again with this engine",
    "BlockCorrupted": "delete the block (`graftmem delete ID`) and learn or pull it again",
    "UnverifiedBlock": "re-derive it (`graftmem verify ID --rederive`) or pass --allow-unverified",
    "BlockRejected": "learn the text again with this engine",
    "UntrustedBundle": "trust the signer's key (--trust KEY.pub), or import without --require-signature",
    "BundleRejected": "get the bundle again from its source; nothing was written",
    "AccessDenied": "pass the server's key or token (--api-key / --token, or $GRAFTMEM_API_KEY)",
    "TransferError": "retry: downloads resume where they stopped",
    "ModelNotFound": "install the model's package (the message names it) or give a GGUF path",
    "UnsupportedFeature": "use what the message names instead",
    "ConfigError": "fix the argument or setting the message names",
    "EngineError": "llama.cpp refused: check --config (n_ctx) against the text's length",
}


def _fix(exc: BaseException) -> Optional[str]:
    for cls in type(exc).__mro__:
        if cls.__name__ in FIXES:
            return FIXES[cls.__name__]
    return None


#: Errors whose message names the damage but not the step (it is raised deep in the store, which does not
#: know which door the caller came through): the plain line ends with the fix, as ``--json``'s ``fix`` has it.
FIX_ON_THE_LINE = ("BlockCorrupted", "BlockNotFound")


def _fail(exc: BaseException, as_json: bool, code: int = 2) -> int:
    message = str(exc)
    fix = _fix(exc)
    if as_json:
        err: dict[str, Any] = {"type": type(exc).__name__, "message": message, "fix": fix, "exit_code": code}
        print(json.dumps({"error": err}))
    else:
        said = any(c.__name__ in FIX_ON_THE_LINE for c in type(exc).__mro__) and fix
        print(f"error: {message}" + (f"; fix: {fix}" if said else ""), file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .. import GraftmemError

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _fail(exc, as_json)
    try:
        if getattr(args, "config", None):  # a typo in --config is refused by every command, engine or not
            from .common import _config

            _config(args)
        return int(args.func(args))
    except GraftmemError as exc:
        return _fail(exc, as_json)
    except (OSError, ValueError, UnicodeError) as exc:  # bad input the API did not name: still one line
        return _fail(exc, as_json)
    except KeyboardInterrupt:
        if as_json:
            print(json.dumps({"error": {"type": "KeyboardInterrupt", "message": "interrupted", "fix": None,
                                        "exit_code": 130}}))
        else:
            print("interrupted", file=sys.stderr)
        return 130
