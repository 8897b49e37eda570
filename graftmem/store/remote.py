"""The object-storage client of the fleet store: one S3-compatible bucket (AWS S3, MinIO, R2, Ceph RGW,
SeaweedFS ...) behind a few calls, with bounded retries and our typed errors.

Why obstore: it is a thin Python binding of the Rust ``object_store`` crate (the one Apache Arrow,
DataFusion and delta-rs use), with conditional puts (``PutMode.Create`` sends ``If-None-Match: *``),
multipart uploads that are invisible until completed, streaming range gets, retries with
exponential back-off and jitter built in, no boto3/aiobotocore dependency tree, and it releases the
GIL for the transfer, so several threads fetch at once.

Configuration is the standard AWS one and nothing graftmem-specific: ``AWS_ENDPOINT_URL`` (for
anything that is not AWS itself), ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``; an ``http://`` endpoint is allowed as given.

A bucket that does not exist yet is created on the first listing that finds it missing (`create_bucket`:
S3's CreateBucket, signed with the same credentials), where those credentials may; where they may not,
the error says so and names the storage's own tools.

Errors: a missing object is [`BlockNotFound`][graftmem.BlockNotFound]; refused credentials are
[`AccessDenied`][graftmem.AccessDenied]; a bucket that stays unreachable or answers 5xx through every
retry is [`TransferError`][graftmem.TransferError] naming the endpoint and what was being done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional
from urllib.parse import urlparse

from ..core.errors import AccessDenied, BlockNotFound, ConfigError, TransferError

if TYPE_CHECKING:  # obstore's option dicts are stubs only, not importable at run time
    from obstore.store import ClientConfig, RetryConfig, S3Config

_FORBIDDEN = re.compile(r"\b403 Forbidden\b|\bstatus(?: code)?:? 403\b")

__all__ = ["Bucket", "RetryPolicy", "parse_url"]

log = logging.getLogger("graftmem")

#: Above this size a block is uploaded in parts (S3 multipart: invisible until completed); below,
#: in one conditional PUT. 5 GiB is S3's single-PUT limit; parts bound the memory and resend cost.
MULTIPART_ABOVE = 256 << 20
PART_SIZE = 16 << 20


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential back-off and jitter (obstore's own), per request.

    ``retries`` attempts after the first, all within ``retry_timeout`` seconds; ``connect_timeout``
    bounds one connection attempt and ``timeout`` one whole request (a 100 MB block on a slow link
    needs minutes: raise it there)."""

    retries: int = 4
    retry_timeout: float = 20.0
    init_backoff: float = 0.1
    max_backoff: float = 4.0
    connect_timeout: float = 5.0
    timeout: float = 300.0


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``("bucket", "prefix")`` (prefix without slashes at its ends)."""
    if not isinstance(url, str):
        raise ConfigError(f"a store URL is a str like s3://bucket/prefix, got {type(url).__name__}")
    p = urlparse(url)
    if p.scheme != "s3" or not p.netloc:
        raise ConfigError(f"{url!r} is not an object-store URL: give s3://bucket[/prefix]")
    if p.query or p.fragment:
        raise ConfigError(f"{url!r}: a store URL has no query or fragment (configure the endpoint with "
                          "AWS_ENDPOINT_URL)")
    return p.netloc, p.path.strip("/")


def _endpoint() -> Optional[str]:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class Bucket:
    """One bucket and prefix; keys passed to the methods are relative to the prefix."""

    def __init__(self, url: str, *, retry: RetryPolicy = RetryPolicy()) -> None:
        try:
            from obstore.store import S3Store
        except ImportError as exc:
            raise ConfigError("an s3:// store needs obstore: pip install '.[s3]' in the graftmem clone "
                              "(it is not on a package index)") from exc

        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self.endpoint = _endpoint()
        # copy-if-not-exists as S3 does it natively: a multipart copy completed with If-None-Match: *
        # (`put_large_once`; SeaweedFS 4.48 answers 412 there too, tests/test_fleet.py)
        config: S3Config = {"copy_if_not_exists": "multipart"}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            config["region"] = region
        client: ClientConfig = {"connect_timeout": timedelta(seconds=retry.connect_timeout),
                                  "timeout": timedelta(seconds=retry.timeout)}
        if self.endpoint and self.endpoint.startswith("http://"):
            client["allow_http"] = True
        retry_config: RetryConfig = {"max_retries": retry.retries, "retry_timeout": timedelta(seconds=retry.retry_timeout),
                        "backoff": {"init_backoff": timedelta(seconds=retry.init_backoff),
                                    "max_backoff": timedelta(seconds=retry.max_backoff), "base": 2}}
        try:
            self.store = S3Store(self.bucket, prefix=self.prefix or None, config=config, client_options=client,
                                 retry_config=retry_config)
        except Exception as exc:  # obstore's configuration errors (unknown key, bad URL)
            raise ConfigError(f"cannot configure the object store for {url}: {exc}") from exc
        self.where = f"{url} ({self.endpoint or 'AWS'})"
        self.multipart_above = MULTIPART_ABOVE  #: bytes above which an upload goes in parts
        self.part_size = PART_SIZE  #: bytes per part (S3: at least 5 MiB but the last)

    # ------------------------------------------------------------------ errors
    @contextlib.contextmanager
    def _errors(self, doing: str, key: str) -> Iterator[None]:
        from obstore import exceptions as ox

        try:
            yield
        except (ox.NotFoundError, FileNotFoundError) as exc:  # obstore raises the latter for a 404
            raise BlockNotFound(f"{key} is not in {self.where} ({doing})") from exc
        except (ox.PermissionDeniedError, ox.UnauthenticatedError) as exc:
            raise AccessDenied(f"{self.where} refused the credentials while {doing} {key}: check "
                               f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ({_short(exc)})") from exc
        except ox.AlreadyExistsError:
            raise
        except (ox.BaseError, OSError) as exc:
            msg = str(exc)
            # an HTTP 403 as the client words it ("403 Forbidden"), or S3's error codes; never a bare "403"
            # (it is in port numbers and hex keys: a refused connection to 127.0.0.1:40331 read as bad keys)
            if (_FORBIDDEN.search(msg) or "SignatureDoesNotMatch" in msg or "InvalidAccessKeyId" in msg
                    or "AccessDenied" in msg):
                raise AccessDenied(f"{self.where} refused the credentials while {doing} {key}: check "
                                   f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ({_short(exc)})") from exc
            if "NoSuchBucket" in msg:
                raise NoSuchBucket(f"the bucket of {self.where} does not exist ({doing} {key}); create it "
                                   "first") from exc
            raise TransferError(f"object storage {self.where} failed while {doing} {key} after retries with "
                                f"back-off: {_short(exc)}") from exc

    # ------------------------------------------------------------------ calls
    def put(self, key: str, data: "bytes | memoryview | Path", *, create: bool, size: Optional[int] = None) -> Optional[str]:
        """Write an object; return its ETag, or None if ``create`` and it already existed (nothing was
        written). ``create`` sends ``If-None-Match: *`` (one PUT); a ``Path`` above `MULTIPART_ABOVE`
        without ``create`` goes up in parts (never visible before the last part is completed)."""
        import obstore
        from obstore import exceptions as ox

        n = size if size is not None else (data.stat().st_size if isinstance(data, Path) else len(data))
        multipart = not create and n > self.multipart_above
        with self._errors("writing", key):
            try:
                if isinstance(data, Path):
                    with open(data, "rb") as f:
                        body: Any = f if multipart else f.read()
                        res = obstore.put(self.store, key, body, mode="create" if create else "overwrite",
                                          use_multipart=multipart, chunk_size=self.part_size, max_concurrency=4)
                else:
                    res = obstore.put(self.store, key, data, mode="create" if create else "overwrite",
                                      use_multipart=multipart, chunk_size=self.part_size, max_concurrency=4)
            except (ox.AlreadyExistsError, ox.PreconditionError):
                return None
        return res.get("e_tag") or ""

    def put_large_once(self, key: str, path: Path, staging_key: str, *, size: Optional[int] = None) -> Optional[str]:
        """Write a large file under ``key`` only if nothing is there; return "" once written, or None if
        an object was there (nothing was written over it).

        Why not `put` with ``create``: obstore sends a conditional write as ONE PUT only (it reads the
        whole file into memory, and S3 takes at most 5 GiB in one PUT), and its multipart upload has
        no condition. So the file goes up in parts, unconditionally, under ``staging_key`` (a name
        only this writer uses), then is copied server-side to ``key`` as S3 makes a copy conditional:
        a multipart copy completed with ``If-None-Match: *``, refused (412) if ``key`` exists by then,
        so of two racing writers exactly one wins. The staging object is deleted either way (a writer
        killed in between leaves it for `FleetStore.collect_garbage`). S3 copies one part of at most
        5 GiB: a larger file fails here with a `TransferError`."""
        from obstore import exceptions as ox
        import obstore

        self.put(staging_key, path, create=False, size=size)
        try:
            with self._errors("copying to", key):
                try:
                    obstore.copy(self.store, staging_key, key, overwrite=False)
                except (ox.AlreadyExistsError, ox.PreconditionError):
                    return None
        finally:
            self.delete(staging_key)
        return ""

    def get(self, key: str) -> Any:
        """The whole object as a buffer (obstore ``Bytes``: no copy into Python)."""
        import obstore

        with self._errors("reading", key):
            return obstore.get(self.store, key).bytes()

    def get_parts(self, key: str, size: int, *, parts: int = 4,
                  on_part: Optional[Callable[[int, memoryview], None]] = None) -> list[tuple[int, Any]]:
        """Download an object of known ``size`` into memory in ``parts`` concurrent range requests;
        return ``(offset, bytes)`` per part, in order. ``on_part(offset, view)`` is called in the part's
        thread as it lands (the caller copies it on while other parts are in flight); every call has
        returned when this returns or raises. The last range asks one byte past ``size``: a longer
        object shows itself as more bytes than ``size`` in total (the caller refuses it). A size of 0
        (unknown) or below 8 MiB is one plain GET."""
        import obstore

        if size <= 0 or parts <= 1 or size < (8 << 20):
            data = self.get(key)
            if on_part is not None:
                on_part(0, memoryview(data))
            return [(0, data)]
        step = -(-size // parts)

        def part(i: int) -> tuple[int, Any]:
            start, end = i * step, min(size, (i + 1) * step)
            last = end == size  # one byte past the end: a longer object shows itself (and is refused)
            with self._errors("reading", key):
                data = obstore.get_range(self.store, key, start=start, end=end + 1 if last else end)
            if on_part is not None and (last or len(data) == end - start):  # else the caller refuses it
                on_part(start, memoryview(data))
            return start, data

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=parts) as pool:  # waits for every part, also on an error
            futures = [pool.submit(part, i) for i in range(parts)]
            return [f.result() for f in futures]

    def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Any]:
        import obstore

        with self._errors("reading", key):
            return obstore.get_ranges(self.store, key, starts=starts, ends=ends)

    def head(self, key: str) -> Optional[dict[str, Any]]:
        """The object's metadata (size, e_tag, last_modified), or None if there is none."""
        import obstore

        try:
            with self._errors("looking up", key):
                return dict(obstore.head(self.store, key))
        except BlockNotFound:
            return None

    def list(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under ``prefix`` (path relative to the store's prefix, size, e_tag,
        last_modified), following the listing's pages."""
        import obstore

        for attempt in (1, 2):
            out: list[dict[str, Any]] = []
            try:
                with self._errors("listing", prefix):
                    for batch in obstore.list(self.store, prefix=prefix, chunk_size=1000):
                        out.extend(dict(o) for o in batch)
                return out
            except NoSuchBucket:
                if attempt == 2:
                    raise
                self.create_bucket()  # a new store's first look: make its bucket, then list (empty)
        return out

    def create_bucket(self) -> None:
        """Create the bucket (S3 CreateBucket, SigV4-signed with the AWS_* credentials: obstore has no
        call for it). Already there (ours or created meanwhile by another worker) is fine; credentials
        that may not create buckets get an error that names the storage's own tools."""
        import httpx

        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        if self.endpoint:
            url = f"{self.endpoint.rstrip('/')}/{self.bucket}"
        else:
            url = f"https://{self.bucket}.s3.{region}.amazonaws.com/"
        body = b"" if region == "us-east-1" or self.endpoint else (
            '<CreateBucketConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><LocationConstraint>'
            f"{region}</LocationConstraint></CreateBucketConfiguration>").encode()
        headers = _sigv4("PUT", url, body, region)
        try:
            r = httpx.put(url, content=body, headers=headers, timeout=30.0)
        except httpx.HTTPError as exc:
            raise TransferError(f"cannot reach {self.where} to create its bucket: {exc}") from exc
        if r.status_code in (200, 204) or "BucketAlreadyOwnedByYou" in r.text:
            log.info("fleet store: created the bucket %s at %s", self.bucket, self.endpoint or "AWS")
            return
        if r.status_code == 409:  # created meanwhile (by another worker), or a name taken on AWS
            if "BucketAlreadyExists" in r.text and not self.endpoint:
                raise ConfigError(f"the bucket name {self.bucket!r} is taken by another AWS account: choose another")
            return
        if "SignatureDoesNotMatch" in r.text or "InvalidAccessKeyId" in r.text:
            raise AccessDenied(f"{self.where} refused the credentials while creating its bucket: check "
                               "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        raise TransferError(f"the bucket of {self.where} does not exist and creating it was refused "
                            f"(HTTP {r.status_code}: {_short(Exception(r.text))}): create it with the storage's "
                            "own tool (aws s3 mb s3://BUCKET, mc mb ALIAS/BUCKET, weed shell's s3.bucket.create) "
                            "or use credentials that may create buckets")

    def delete(self, key: str) -> None:
        """Delete an object (absent is fine: S3 answers 204 either way)."""
        import obstore

        try:
            with self._errors("deleting", key):
                obstore.delete(self.store, key)
        except BlockNotFound:
            pass


class NoSuchBucket(TransferError):
    """The bucket does not exist (S3's NoSuchBucket); `Bucket.list` creates it and lists again."""


def _sigv4(method: str, url: str, body: bytes, region: str) -> dict[str, str]:
    """The headers of an AWS Signature Version 4 request for service s3 (the credentials of the AWS_*
    variables; none: unsigned, for a storage that needs no key)."""
    import hashlib
    import hmac
    from datetime import datetime, timezone
    from urllib.parse import quote

    key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    u = urlparse(url)
    payload = hashlib.sha256(body).hexdigest()
    now = datetime.now(timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"host": u.netloc, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    if os.environ.get("AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = os.environ["AWS_SESSION_TOKEN"]
    if not key_id or not secret:
        return headers
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, quote(u.path or "/", safe="/-_.~"), "",
                            "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])

    def mac(k: bytes, m: str) -> bytes:
        return hmac.new(k, m.encode(), hashlib.sha256).digest()

    k = mac(mac(mac(mac(("AWS4" + secret).encode(), day), region), "s3"), "aws4_request")
    sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={key_id}/{scope}, SignedHeaders={signed}, "
                                f"Signature={sig}")
    return headers


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400] + ("..." if len(text) > 400 else "")
