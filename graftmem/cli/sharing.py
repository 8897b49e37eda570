"""Moving blocks: upload to a bucket, bundles (export / import), pull and push over HTTP, keys."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from .common import _memory, _out, _policy, _sign_key, _store, _transfer_text


def cmd_upload(args: argparse.Namespace) -> int:
    from .. import ConfigError
    from ..store import FleetStore, Home, Store

    source = Path(args.source).expanduser()
    layout = Home(source)
    if not layout.index.is_file() and not layout.blocks.is_dir():
        raise ConfigError(f"{source} is not a graftmem store (no blocks/ or index.sqlite)")
    store = _store(args)
    try:
        if not isinstance(store, FleetStore):  # upload_store is the bucket store's own verb
            raise ConfigError("upload copies a local store into a bucket: give --store s3://bucket/prefix "
                              "(or $GRAFTMEM_STORE)")
        src = Store(source)
        try:
            done = store.upload_store(src)
            total = src.stats().blocks
        finally:
            src.close()
        sent = store.counters["put_bytes"]
    finally:
        store.close()
    _out(args, {"uploaded": done, "blocks": total, "bytes": sent},
         f"uploaded {len(done)} of {total} blocks ({sent:,} bytes) to {store.url}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..share import export

    store = _store(args)
    try:
        rep = export(store, args.path, args.ids or None, kind=args.kind, sign_key=_sign_key(args),
                     progress=not args.json)
    finally:
        store.close()
    _out(args, rep, f"exported {len(rep.blocks)} blocks to {rep.path}: {rep.bytes:,} bytes in "
                    f"{rep.seconds:.2f} s" + (f", signed by {rep.signer}" if rep.signer else ""))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    policy = _policy(args)
    with _memory(args) as mem:
        rep = mem.import_bundle(args.path, incompatible=args.incompatible, policy=policy,
                                rederive=args.rederive, progress=not args.json)
    _out(args, rep, _transfer_text("imported", rep))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    policy = _policy(args)
    with _memory(args) as mem:
        rep = mem.pull(args.url, args.ids or None, kind=args.kind, incompatible=args.incompatible,
                       policy=policy, rederive=args.rederive, progress=not args.json,
                       api_key=args.api_key or os.environ.get("GRAFTMEM_API_KEY") or None)
    _out(args, rep, _transfer_text("pulled from", rep))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from ..share import push

    token = args.token or os.environ.get("GRAFTMEM_PUSH_TOKEN")
    if not token:
        from .. import ConfigError

        raise ConfigError("push needs the server's token: --token or $GRAFTMEM_PUSH_TOKEN")
    store = _store(args)
    try:
        rep = push(store, args.url, args.ids or None, token=token, kind=args.kind,
                   sign_key=_sign_key(args), progress=not args.json)
    finally:
        store.close()
    _out(args, rep, _transfer_text(f"pushed to {args.url}; server imported", rep))
    return 0


def _key_mode(api_key: Any) -> str:
    if not api_key:
        return "off: one local trust domain"
    if isinstance(api_key, str) or not getattr(api_key, "named", False):
        return "required: one trust domain"
    return f"required: {len(api_key.entries)} tenants"


def cmd_keygen(args: argparse.Namespace) -> int:
    from ..share import SigningKey

    key = SigningKey.generate()
    pub = key.save(args.path)
    _out(args, {"private": args.path, "public": str(pub), "key_id": key.public_key.key_id},
         f"wrote {args.path} (private, keep it) and {pub} (public, give it to importers); "
         f"key id {key.public_key.key_id}")
    return 0
