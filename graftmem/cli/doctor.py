"""``graftmem doctor``: the machine, the model, the fingerprint, the exactness probe, the store."""

from __future__ import annotations

import argparse

from .common import _memory, _out, _store


def _system_lines() -> list[str]:
    """What llama.cpp sees here, read before a model loads: printed first, so that a user whose host
    breaks a kernel learns the CPU features and devices even if nothing after this line appears."""
    from .. import system_report

    info = system_report()
    return [f"llama.cpp    llama-cpp-python {info['llama_cpp_version']}, build {info['llama_build']}, "
            f"GPU offload {'available' if info['gpu_offload'] else 'not built'}",
            f"devices      {'; '.join(info['devices']) or '(not reported by this build)'}",
            f"cpu          {info['system_info']}"]


def _health(bad: list[str], checked_bytes: bool) -> str:
    """The store's verdict, saying how deep it looked: without ``--check-bytes`` the files' headers,
    manifests and trailers are checked, not the state bytes (a damaged state is found by the next read of
    it, or by ``--check-bytes``, which reads the whole store)."""
    if bad:
        return (f"{len(bad)} unreadable: " + "; ".join(bad)
                + "; fix: `graftmem delete ID`, then learn, pull or import it again")
    return ("ok (every block's state bytes checked: BLAKE3)" if checked_bytes else
            "ok (headers, manifests, trailers; --check-bytes also reads every state)")


def cmd_doctor(args: argparse.Namespace) -> int:
    from .. import system_report

    if not args.json:
        print("\n".join(_system_lines()), flush=True)
    store = _store(args)
    try:
        fixed = store.reconcile()
        st = store.stats()
        summary = {"blocks": st.blocks, "tokens": st.tokens, "bytes": st.bytes_on_disk, "kinds": st.kinds}
        bad = []
        for b in store.list():
            try:
                if args.check_bytes:  # every state byte read and hashed (BLAKE3): as long as reading the store
                    store.read_state(b.id, lambda n: memoryview(bytearray(n)))
                else:
                    store.check_file(b.id)
            except Exception as exc:  # noqa: BLE001 - report every unreadable block, keep going
                bad.append(f"{b.short_id}: {exc}")
    finally:
        store.close()
    with _memory(args) as mem:
        fp, ex = mem.fingerprint, mem.exactness
        path = mem.engine.model_path
        extra_setting, extra_used = mem.engine.config.extra_bufts, mem.engine.extra_bufts
    report = {"system": system_report(), "weights": {"extra_bufts": extra_setting, "extra_bufts_used": extra_used,
                                                     "weight_buffers": fp.weight_buffers},
              "model": fp.model_name, "model_path": str(path), "fingerprint": fp.model_dump(),
              "fingerprint_digest": fp.digest(), "exactness": ex.model_dump(), "home": str(store.home),
              "store": summary, "reconciled": fixed, "unreadable_blocks": bad, "bytes_checked": args.check_bytes}
    lines = [f"model        {fp.model_name}  ({path})", f"model sha256 {fp.model_sha256}",
             f"backend      {fp.backend}",
             f"engine       n_ctx={fp.n_ctx} n_batch={fp.n_batch} n_ubatch={fp.n_ubatch} kv={fp.type_k}/{fp.type_v} "
             f"flash_attn={fp.flash_attn} swa_full={fp.swa_full} threads={fp.n_threads} gpu_layers={fp.n_gpu_layers}",
             f"weights      {fp.weight_buffers} buffers (extra_bufts={extra_setting}: llama.cpp's repack/AMX "
             f"buffer types {'in use' if extra_used else 'off'})",
             f"fingerprint  {fp.digest()}", f"exact        {ex.exact}: {ex.reason}",
             f"store        {store.home}: {summary['blocks']} blocks, {summary['tokens']} tokens, "
             f"{summary['bytes']:,} bytes", f"reconciled   {fixed}",
             f"health       {_health(bad, args.check_bytes)}"]
    _out(args, report, "\n".join(lines))
    return 0 if ex.exact and not bad else 1
