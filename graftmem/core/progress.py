"""The one progress bar helper: tqdm on long work (learning a long text, building a store, moving
bundles), nothing on short work or when the caller said no.

Callers get ``None`` or a bar and feed ``bar.update`` as a progress callback; keeping the policy (when a
bar is worth showing, which units) here means learn, the pager, bundles and transfers look alike.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, enabled: bool, *, unit: Literal["tok", "B"] = "tok",
                 min_total: int = 0, leave: bool = False) -> Optional[Any]:
    """A tqdm bar over ``total`` units, or None when disabled or ``total < min_total``.

    Bytes are shown scaled (KiB, MiB); tokens as counts. tqdm is imported only when a bar is made.
    """
    if not enabled or total < min_total:
        return None
    from tqdm.auto import tqdm

    if unit == "B":
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=leave)
    return tqdm(total=total, desc=desc, unit="tok", leave=leave, dynamic_ncols=True)
