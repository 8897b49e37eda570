"""Fleet-wide learning rules: how often the fleet has seen a prompt prefix, and which worker writes
it, kept in the bucket so that a worker's own memory is not the only witness.

Why: the prompt cache learns a prefix once it has been seen ``sightings`` times
(`graftmem.server.prefix.PrefixCache.learn_target`). A count kept in each process's memory never
reaches 2 behind a round-robin proxy when the prefix lands once on each of two workers; with the count
in the bucket, the second sighting anywhere is the second sighting. And once a prefix is due, several
workers may see it at the same moment: only one should prefill-capture-hash-upload it.

Bucket layout (beside the blocks, under the URL's prefix; ``<key>`` is the prefix key's hex, a salted
SHA-256 of token ids, `graftmem.server.prefix.prefix_keys`, so it names no text)::

    sightings/<key>/<n>   the n-th sighting of the prefix by any worker: an empty object created with
                          If-None-Match: *, n = 1, 2, ... A worker tries n = 1 first and the next n
                          while the create is refused (412), so each sighting gets its own n and the
                          n a worker gets IS the fleet's count, with no read-modify-write to race.
                          At most ``sightings`` objects per prefix: beyond, it is due.
    leases/<key>          who writes the prefix's blocks: created with If-None-Match: * by the worker
                          that is about to learn it; JSON {"owner", "t"}. Another worker that finds a
                          lease younger than ``lease_ttl`` seconds (its object's Last-Modified) leaves
                          the prefix to its owner; an older one (its owner died before its marker
                          appeared) is deleted and created again, and of the workers doing so at once
                          the create lets one win. The lease is not removed after the write: the
                          blocks' markers say "learned" to every worker at its next listing, and the
                          lease covers the listing's delay. `collect_garbage` removes both kinds once
                          older than its grace period.

What the rule guarantees and what it does not: a block is still written create-once (the bucket
keeps one copy whatever happens, `graftmem.store.fleet.writes`); the lease saves the duplicate
prefill-capture-upload work and keeps the fleet's count of "learned" at one. The takeover of a stale
lease (delete, then create) can, when two workers find the same stale lease at the same instant and
one's delete lands after the other's create, let both write: both write the same bytes, and the
create-once block object keeps one. Clocks: the lease's age is the worker's clock minus the object
store's Last-Modified; workers and store within a few seconds of each other (NTP) is assumed.

Best effort by design: a bucket that fails a sighting or a lease call costs the fleet-wide count (the
caller falls back to its own), never an answer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Optional

from ...core.errors import GraftmemError
from ..remote import Bucket

__all__ = ["FleetSightings", "DEFAULT_LEASE_TTL", "SIGHTINGS", "LEASES"]

log = logging.getLogger("graftmem")

SIGHTINGS, LEASES = "sightings", "leases"

#: Seconds a learn lease holds off other workers: longer than a learn's capture, hash and upload takes
#: (a few seconds for a 3,000-token prefix), so a live owner is never overtaken; a dead owner's prefix
#: is learned by another worker this long after it died.
DEFAULT_LEASE_TTL = 120.0


def sighting_key(key: bytes, n: int) -> str:
    return f"{SIGHTINGS}/{key.hex()}/{n}"


def lease_key(key: bytes) -> str:
    return f"{LEASES}/{key.hex()}"


class FleetSightings:
    """Sighting counts and learn leases of one bucket (see the module doc)."""

    def __init__(self, bucket: Bucket, *, url: str, counters: dict[str, int],
                 lease_ttl: float = DEFAULT_LEASE_TTL, owner: Optional[str] = None) -> None:
        self.bucket, self.url, self.counters = bucket, url, counters
        self.lease_ttl = float(lease_ttl)
        #: this worker's name in its leases (host, pid and a random part: a restarted pid is another owner)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def sight(self, key: bytes, limit: int) -> int:
        """Record one sighting of the prefix ``key``; the fleet's count of its sightings, this one
        included (``limit`` + 1 when it was seen ``limit`` times before: due, and counted no further)."""
        for n in range(1, limit + 1):
            tag = self.bucket.put(sighting_key(key, n), b"", create=True)
            self.counters["puts"] += 1
            if tag is not None:
                return n
        return limit + 1

    def seen(self, key: bytes) -> int:
        """How many sightings of ``key`` the bucket holds (a listing: for tests and ``stats``)."""
        self.counters["lists"] += 1
        return len(self.bucket.list(f"{SIGHTINGS}/{key.hex()}/"))

    def acquire(self, key: bytes) -> bool:
        """Take the learn lease of prefix ``key``: True if this worker may write its blocks now (it
        created the lease, or took over one older than ``lease_ttl``); False if another worker holds it."""
        body = json.dumps({"owner": self.owner, "t": time.time()}).encode()
        lk = lease_key(key)
        if self.bucket.put(lk, body, create=True) is not None:
            self.counters["puts"] += 1
            return True
        head = self.bucket.head(lk)
        if head is None:  # released between our create and our look: try once more
            return self.bucket.put(lk, body, create=True) is not None
        age = time.time() - head["last_modified"].timestamp()
        if age <= self.lease_ttl:
            return False
        log.info("fleet store %s: a learn lease %.0f s old (its owner stopped?) is taken over", self.url, age)
        self.bucket.delete(lk)
        return self.bucket.put(lk, body, create=True) is not None

    def holder(self, key: bytes) -> Optional[str]:
        """The owner named in prefix ``key``'s lease, if there is one."""
        try:
            return json.loads(bytes(self.bucket.get(lease_key(key)))).get("owner")
        except (GraftmemError, ValueError):
            return None

    def learn_target(self, candidates: list[tuple[int, bytes]], limit: int, best: int, keys: "list[bytes]") -> int:
        """The fleet's side of `PrefixCache.learn_target`: sight each candidate prefix (``(k, key)``: its
        count of segments and its key, long enough and not learned yet), learn the longest one seen
        ``limit`` times fleet-wide (or ``best``, a prefix the client marked, if longer), and only under
        this worker's lease of its key (``keys[k - 1]``). Returns that count of segments, 0: none now."""
        try:
            for k, key in candidates:
                if self.sight(key, limit) >= limit:
                    best = max(best, k)
        except GraftmemError as exc:  # the count is lost for this request, nothing else
            log.warning("fleet store %s: prefix sightings not counted: %s", self.url, exc)
        if best <= 0:
            return 0
        try:
            if not self.acquire(keys[best - 1]):
                log.debug("fleet store %s: a %d-segment prefix is being learned by another worker", self.url, best)
                return 0
        except GraftmemError as exc:  # no lease to be had: learn anyway (the block is written create-once)
            log.warning("fleet store %s: learn lease not taken (%s); learning without it", self.url, exc)
        return best
