"""Signatures and the trust policy: who may put state into this store.

A block's digests prove that its bytes were not damaged on the way; they do not prove who made it.
A bundle (or a served listing) may therefore carry an ed25519 signature over its manifest, and the
manifest pins every block by its state digest and its header/manifest digest, so one 64-byte
signature covers every byte of every block. The trust policy says whether a signature is required
and whose keys count. Ed25519 comes from ``cryptography`` (pyca): deterministic signatures, small
keys, no parameters to get wrong.

Rules (`check()`):

* a signature that does not verify is refused, always (it is evidence of tampering);
* when the policy requires signatures, an unsigned manifest or one signed by an unlisted key is refused;
* otherwise the manifest is accepted and the signer (if any) is reported, trusted or not.

Key files are one line of text, like OpenSSH's: ``graftmem-ed25519 <base64> [comment]`` for a public
key, ``graftmem-ed25519-private <base64 seed>`` (mode 0600) for a private one. The policy lives in
``<home>/trust.json``.

Messages are domain-separated (``graftmem/<domain>\\0`` + bytes) so a signature over a listing can
never be replayed as a signature over a bundle.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..core.errors import ConfigError, UntrustedBundle
from ..store.home import Home
from ..store.local import atomic_file

__all__ = ["PublicKey", "SigningKey", "Signature", "TrustPolicy", "TrustResult", "POLICY_FILE"]

POLICY_FILE = Home(Path(".")).trust_policy.name
_PUB_TAG = "graftmem-ed25519"
_PRIV_TAG = "graftmem-ed25519-private"


def _message(domain: str, data: bytes) -> bytes:
    return b"graftmem/" + domain.encode() + b"\0" + data


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"{what} is not valid base64: {exc}") from exc


class PublicKey:
    """An ed25519 public key (32 raw bytes)."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) != 32:
            raise ConfigError(f"an ed25519 public key is 32 bytes, got {len(raw)}")
        self.raw = bytes(raw)

    @property
    def b64(self) -> str:
        return base64.b64encode(self.raw).decode()

    @property
    def key_id(self) -> str:
        """Short, stable name for logs and reports: the first 16 hex of SHA-256(raw key)."""
        return hashlib.sha256(self.raw).hexdigest()[:16]

    @classmethod
    def parse(cls, text: str) -> "PublicKey":
        """Accept ``graftmem-ed25519 <b64> [comment]`` or a bare base64 key."""
        parts = text.strip().split()
        if not parts:
            raise ConfigError("empty public key")
        b64 = parts[1] if parts[0] == _PUB_TAG and len(parts) > 1 else parts[0]
        return cls(_b64decode(b64, "public key"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "PublicKey":
        try:
            return cls.parse(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read public key {path}: {exc}") from exc

    def to_text(self, comment: str = "") -> str:
        return f"{_PUB_TAG} {self.b64}{' ' + comment if comment else ''}\n"

    def verify(self, domain: str, data: bytes, sig: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(sig, _message(domain, data))
            return True
        except InvalidSignature:
            return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"PublicKey({self.key_id})"


class SigningKey:
    """An ed25519 private key. Keep its file private (it is written with mode 0600)."""

    def __init__(self, seed: bytes) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        if len(seed) != 32:
            raise ConfigError(f"an ed25519 private key is a 32-byte seed, got {len(seed)}")
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self._seed = bytes(seed)
        self.public_key = PublicKey(self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(os.urandom(32))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "SigningKey":
        try:
            parts = Path(path).read_text().split()
        except OSError as exc:
            raise ConfigError(f"cannot read signing key {path}: {exc}") from exc
        if len(parts) < 2 or parts[0] != _PRIV_TAG:
            raise ConfigError(f"{path} is not a graftmem private key (expected '{_PRIV_TAG} <base64>'); "
                              "make one with `graftmem keygen`")
        return cls(_b64decode(parts[1], f"private key {path}"))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the private key (0600) to ``path`` and the public key to ``path + '.pub'``."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{_PRIV_TAG} {base64.b64encode(self._seed).decode()}\n")
        pub = path.with_name(path.name + ".pub")
        pub.write_text(self.public_key.to_text(path.stem))
        return pub

    def sign(self, domain: str, data: bytes) -> "Signature":
        sig = self._key.sign(_message(domain, data))
        return Signature(key=self.public_key.b64, sig=base64.b64encode(sig).decode())


class Signature(BaseModel):
    """A detached signature as stored in a bundle (``graftmem-bundle.sig``) or an HTTP header."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alg: Literal["ed25519"] = "ed25519"
    key: str
    sig: str

    @property
    def public_key(self) -> PublicKey:
        return PublicKey(_b64decode(self.key, "signature key"))

    def to_header(self) -> str:
        return f"{self.alg}:{self.key}:{self.sig}"

    @classmethod
    def from_header(cls, value: str) -> "Signature":
        parts = value.strip().split(":")
        if len(parts) != 3 or parts[0] != "ed25519":
            raise UntrustedBundle(f"malformed signature header {value[:80]!r}")
        return cls(key=parts[1], sig=parts[2])


class TrustResult(BaseModel):
    """Who signed what was accepted: ``signer`` is a key id or None (unsigned)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    signer: Optional[str] = None
    trusted: bool = False


class TrustPolicy(BaseModel):
    """Whether signatures are required, and which public keys (base64) are trusted."""

    model_config = ConfigDict(extra="forbid")

    require_signature: bool = False
    trusted_keys: list[str] = Field(default_factory=list)

    @classmethod
    def load(cls, home: str | os.PathLike[str]) -> "TrustPolicy":
        """The policy in ``<home>/trust.json``, or the default (signatures optional) if there is none."""
        path = Home(Path(home)).trust_policy
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise ConfigError(f"cannot read the trust policy {path}: {exc}") from exc
        try:
            return cls.model_validate_json(raw)
        except ValueError as exc:
            raise ConfigError(f"the trust policy {path} does not parse: {exc}; fix or delete it") from exc

    def save(self, home: str | os.PathLike[str]) -> Path:
        path = Home(Path(home)).trust_policy
        with atomic_file(path) as f:
            f.write((json.dumps(self.model_dump(), indent=2) + "\n").encode())
        return path

    def trust(self, key: PublicKey | str) -> "TrustPolicy":
        """Add a key (a `PublicKey` or its text) to the trusted set; returns self."""
        pk = key if isinstance(key, PublicKey) else PublicKey.parse(key)
        if pk.b64 not in self.trusted_keys:
            self.trusted_keys.append(pk.b64)
        return self

    def _trusted(self) -> set[PublicKey]:
        return {PublicKey.parse(k) for k in self.trusted_keys}

    def check(self, domain: str, data: bytes, signature: Optional[Signature], *, what: str) -> TrustResult:
        """Apply the rules in the module docstring to ``data``; raise [`UntrustedBundle`][graftmem.UntrustedBundle]."""
        if signature is None:
            if self.require_signature:
                raise UntrustedBundle(f"{what} is not signed and the trust policy requires a signature: "
                                      "ask its author to sign it (`--sign KEY`) or relax the policy")
            return TrustResult()
        try:
            pk = signature.public_key
            raw_sig = _b64decode(signature.sig, "signature")
        except ConfigError as exc:
            raise UntrustedBundle(f"{what} carries a malformed signature: {exc}") from exc
        if not pk.verify(domain, data, raw_sig):
            raise UntrustedBundle(f"{what}: the signature by key {pk.key_id} does not verify: the "
                                  "manifest was changed after it was signed; refusing it")
        trusted = pk in self._trusted()
        if self.require_signature and not trusted:
            raise UntrustedBundle(f"{what} is signed by key {pk.key_id}, which the trust policy does not "
                                  "list: add it with `--trust KEY.pub` if you trust its owner")
        return TrustResult(signer=pk.key_id, trusted=trusted)
