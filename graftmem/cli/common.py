"""What every command shares: output (``--json`` or text), the store, engine config and sampling
options read from the arguments, argument types."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    from ..store import BlockStore


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        if hasattr(data, "model_dump_json"):
            print(data.model_dump_json(indent=2))
        else:
            print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


def _config(args: argparse.Namespace) -> Optional[dict]:
    from .. import ConfigError

    if not args.config:
        return None
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config is not JSON ({exc.msg} at character {exc.pos}); "
                          'give an object such as \'{"n_ctx": 4096}\'') from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config must be a JSON object such as '{{\"n_ctx\": 4096}}', got {args.config!r}")
    from ..core import EngineConfig

    EngineConfig.coerce(config)  # checked here, for every command: one that opens no engine (ls) refuses a typo too
    return config


def _store_spec(args: argparse.Namespace) -> Optional[str]:
    """--store, else $GRAFTMEM_STORE (unless --home was given), else None (the local home)."""
    spec = getattr(args, "store", None)
    if spec is None and not args.home:
        spec = os.environ.get("GRAFTMEM_STORE") or None
    if spec is not None and args.home:
        from .. import ConfigError

        raise ConfigError("give --home (a directory) or --store (s3://bucket/prefix or a directory), not both")
    return spec


def _store(args: argparse.Namespace) -> "BlockStore":
    """The store the command works on: the local home, or the fleet store of --store s3://..."""
    from ..store import open_store

    spec = _store_spec(args)
    return open_store(spec if spec is not None else args.home)


def _memory(args: argparse.Namespace):
    from .. import Memory

    spec = _store_spec(args)
    if spec is not None:
        return Memory(args.model, store=spec, config=_config(args))
    return Memory(args.model, home=args.home, config=_config(args))


def _sampling(args: argparse.Namespace):
    from .. import Sampling

    return Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def _answered(args: argparse.Namespace, plain: Callable[[], Any], stream: Callable[[], Any]) -> Any:
    """The Recall of ``plain()``, or with ``--stream`` of ``stream()`` (an AnswerStream) while its text
    is printed as it comes (then a blank line; the caller prints the receipt)."""
    if not args.stream or args.json:
        return plain()
    with stream() as s:
        for piece in s:
            sys.stdout.write(piece)
            sys.stdout.flush()
    return s.result


def _size(n: float) -> str:
    """Bytes for people: 2015268 -> '1.9 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _read_text(path: str) -> str:
    """A text file (or ``-``: stdin) as UTF-8; anything else is a clear error, not a traceback."""
    from .. import ConfigError

    where = "stdin" if path == "-" else path
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no file {path!r} (in {Path.cwd()}): give the path of a text file, or - to read "
                          "the text from stdin (echo 'text' | graftmem learn -)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path!r} is a directory: give one text file (or - for stdin)") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); "
                          "learn text files only, converted first if needed (e.g. iconv -f latin1 -t utf-8)") from None


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: give 1..65535, or 0 for a free one")
    return port


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not allowed: give 1 or more")
    return n


def _seconds(value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 < n < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give a number of seconds above 0")
    return n


def _factor(value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 <= n < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give 0 or a larger number")
    return n


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*map(str, r)) for r in rows])


def _label(text: str, b: Any) -> str:
    """A label as shown: marked when it came from elsewhere and no trusted signature covers it (``b``: a
    block, or a listing line: the same rule for a local and a remote store)."""
    trusted = b.get("labels_trusted") if isinstance(b, dict) else b.labels_trusted
    return text if trusted else f"{text} (unverified label)"


# --------------------------------------------------------------------- sharing (bundles, HTTP, trust)
def _home(args: argparse.Namespace) -> Path:
    from ..store import default_home

    return Path(args.home).expanduser() if args.home else default_home()


def _policy(args: argparse.Namespace):
    from ..share import PublicKey, TrustPolicy

    pol = TrustPolicy.load(_home(args))
    if args.require_signature:
        pol.require_signature = True
    for k in args.trust or []:
        pol.trust(PublicKey.load(k))
    return pol


def _sign_key(args: argparse.Namespace):
    from ..share import SigningKey

    return SigningKey.load(args.sign) if args.sign else None


def _transfer_text(verb: str, rep: Any) -> str:
    mbps = rep.bytes / 1e6 / rep.seconds if rep.seconds > 0 else 0.0
    signer = (f"; signed by {rep.signer} ({'trusted' if rep.signer_trusted else 'not in the trust policy'})"
              if rep.signer else "; unsigned")
    return (f"{verb} {rep.source}: {len(rep.added)} added, {len(rep.present)} already present, "
            f"{len(rep.kept_apart)} kept apart, {len(rep.skipped)} skipped; {rep.bytes:,} bytes in "
            f"{rep.seconds:.2f} s ({mbps:.0f} MB/s){signer}")


# --------------------------------------------------------------------- scopes (user / agent / session)
def _scope_options(sp: argparse.ArgumentParser, what: str) -> None:
    """--user-id / --agent-id / --session-id, as `Memory` takes them (``what``: what the scope does here)."""
    for field in ("user", "agent", "session"):
        sp.add_argument(f"--{field}-id", metavar="ID", default=None, help=f"{what} ({field} scope)")


def _scope_kw(args: argparse.Namespace) -> dict[str, Optional[str]]:
    """The scope given on the command line, as keyword arguments of the API (None: not given)."""
    return {k: getattr(args, k, None) for k in ("user_id", "agent_id", "session_id")}


def _scoped(args: argparse.Namespace) -> bool:
    return any(v is not None for v in _scope_kw(args).values())


@contextmanager
def _access(args: argparse.Namespace) -> Iterator[tuple["BlockStore", Any, Any]]:
    """(store, `Access` in the operator's view, the `Scope` given) for the verbs that need no model (ls,
    show, delete): the same rule of who sees what as `Memory` and the server use."""
    from .. import ConfigError, Scope
    from ..memory import Access
    from ..store import ScopeIndex

    given = _scope_kw(args)
    if any(v is not None and not v.strip() for v in given.values()):
        raise ConfigError("--user-id, --agent-id and --session-id take a non-empty id")
    scope = Scope(**given)
    store = _store(args)
    opened: list[ScopeIndex] = []

    def scopes() -> ScopeIndex:
        if not opened:
            opened.append(ScopeIndex(store.home, timeout=store.lock_timeout))
        return opened[0]
    try:
        yield store, Access(store, scopes=scopes, operator=True), scope
    finally:
        for idx in opened:
            idx.close()
        store.close()
