"""The master's signatures: Ed25519 over a canonical encoding, verified once and cached.

Theory of operation. The master holds one Ed25519 key, made at its first start and kept
in its metadata (so a standby master on the same metadata signs with the same key). It
signs two kinds of things, epoch grants (`protocol.grants`) and tenant tokens
(`protocol.tokens`), each as an envelope:

    magic      4 bytes: what is signed, and its format version
    key id     8 bytes: the first 8 bytes of SHA-256 of the signer's public key
    payload    the canonical encoding of the grant or the token's claims
    signature  64 bytes: Ed25519 over magic | key id | payload

The magic separates the domains: a token never verifies as a grant, nor the reverse.
The key id lets a verifier hold several keys (while a key is rotated) and pick one
without trying each. Encodings are canonical (one byte string per value: big-endian
fixed-width integers, length-prefixed UTF-8, no optional parts), so equal values sign
to equal bytes and a decoder refuses anything else, trailing bytes included.

Cost: signing and, more, verifying take longer than the rest of a small write's
handling (docs/performance.md, "Signatures"). So a `Verifier` keeps what it verified (the decoded
value, by the envelope's bytes; bounded, the oldest dropped first): a store verifies a
grant once per (stream, epoch), however many writes and seals carry it.

Pure: no clock, no I/O. Making a new key reads the operating system's randomness, and
only the master's shell does it (`SigningKey.generate`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

MAGIC_BYTES = 4
KEY_ID_BYTES = 8
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
PRIVATE_KEY_BYTES = 32
# Envelopes are small (a grant lists at most UNSEALED_SEGMENTS_MAX + 1 copy sets): a
# bound refuses a huge one before any work is spent on it.
ENVELOPE_BYTES_MAX = 8192
# Verified envelopes kept per verifier: every grant of every open stream a store holds,
# with room to spare; each entry is a few hundred bytes.
VERIFIED_CACHE_MAX = 4096
# Keys a verifier accepts at once: the current one and those being rotated out.
VERIFYING_KEYS_MAX = 8
# Strings inside signed payloads (tenant, client id, store id, token id).
STRING_BYTES_MAX = 255

_HEAD = MAGIC_BYTES + KEY_ID_BYTES
_U8 = struct.Struct(">B")
_U64 = struct.Struct(">Q")

T = TypeVar("T")


class SignatureRefused(ValueError):
    """An envelope that does not verify: malformed, of another kind, signed by a key this
    verifier does not hold, or not signed by it at all. Nothing in it may be trusted."""


class NoVerifyingKey(SignatureRefused):
    """The verifier holds no key yet (a store that has not heard from its master): it
    can trust nothing, and may later."""


class MalformedPayload(ValueError):
    """A payload that is not the canonical encoding of what it claims to be."""


def key_id(public_key: bytes) -> bytes:
    assert len(public_key) == PUBLIC_KEY_BYTES, len(public_key)
    return hashlib.sha256(public_key).digest()[:KEY_ID_BYTES]


class SigningKey:
    """The master's private key."""

    def __init__(self, private_bytes: bytes) -> None:
        if len(private_bytes) != PRIVATE_KEY_BYTES:
            raise ValueError(f"an Ed25519 private key is {PRIVATE_KEY_BYTES} bytes")
        self._key = Ed25519PrivateKey.from_private_bytes(private_bytes)
        self.private_bytes = private_bytes
        self.public_key = self._key.public_key().public_bytes_raw()
        self.key_id = key_id(self.public_key)

    @classmethod
    def generate(cls) -> SigningKey:
        """A new key from the operating system's randomness (the master's first start)."""
        return cls(Ed25519PrivateKey.generate().private_bytes_raw())

    def sign(self, magic: bytes, payload: bytes) -> bytes:
        """The envelope of `payload` (see the module doc)."""
        assert len(magic) == MAGIC_BYTES, magic
        head = magic + self.key_id
        envelope = head + payload + self._key.sign(head + payload)
        assert len(envelope) <= ENVELOPE_BYTES_MAX, len(envelope)
        return envelope


class Verifier:
    """Opens envelopes signed by any of its keys, remembering what it verified."""

    def __init__(
        self, public_keys: Iterable[bytes] = (), cache_max: int = VERIFIED_CACHE_MAX
    ) -> None:
        assert cache_max > 0
        self._cache_max = cache_max
        self._cache: OrderedDict[bytes, object] = OrderedDict()
        self._keys: dict[bytes, Ed25519PublicKey] = {}
        self.set_keys(public_keys)

    @property
    def public_keys(self) -> tuple[bytes, ...]:
        return tuple(key.public_bytes_raw() for key in self._keys.values())

    def set_keys(self, public_keys: Iterable[bytes]) -> None:
        """Accept signatures of exactly these keys from now on (the first is the
        signer's current one, by convention; order does not matter here)."""
        keys: dict[bytes, Ed25519PublicKey] = {}
        for raw in public_keys:
            if len(raw) != PUBLIC_KEY_BYTES:
                raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")
            keys[key_id(raw)] = Ed25519PublicKey.from_public_bytes(raw)
        if len(keys) > VERIFYING_KEYS_MAX:
            raise ValueError(f"more than {VERIFYING_KEYS_MAX} verifying keys")
        if keys.keys() != self._keys.keys():
            # What a dropped key signed must not stay trusted through the cache.
            self._cache.clear()
        self._keys = keys

    def open(self, magic: bytes, envelope: bytes, decode: Callable[[bytes], T]) -> T:
        """`decode(payload)` of an envelope of kind `magic` that verifies; raises
        SignatureRefused (or NoVerifyingKey), or MalformedPayload from `decode`."""
        # The cache holds values of every kind this verifier opened, keyed by their
        # bytes: an envelope of another kind must be refused before it is looked up,
        # or a token verified once would come back as a grant.
        if envelope[:MAGIC_BYTES] != magic:
            raise SignatureRefused("signed for another purpose (or another format version)")
        cached = self._cache.get(envelope)
        if cached is not None:
            self._cache.move_to_end(envelope)
            return cached  # type: ignore[return-value]
        payload = self._verify(magic, envelope)
        value = decode(payload)
        self._cache[bytes(envelope)] = value
        if len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return value

    def _verify(self, magic: bytes, envelope: bytes) -> bytes:
        if not self._keys:
            raise NoVerifyingKey("no signing key of the master is known here yet")
        if not _HEAD + SIGNATURE_BYTES < len(envelope) <= ENVELOPE_BYTES_MAX:
            raise SignatureRefused(f"a signed envelope of {len(envelope)} bytes is malformed")
        assert envelope[:MAGIC_BYTES] == magic  # `open` checked it
        key = self._keys.get(envelope[MAGIC_BYTES:_HEAD])
        if key is None:
            raise SignatureRefused("signed by a key this cluster does not hold")
        signed, signature = envelope[:-SIGNATURE_BYTES], envelope[-SIGNATURE_BYTES:]
        try:
            key.verify(signature, signed)
        except InvalidSignature:
            raise SignatureRefused("the signature does not verify") from None
        return envelope[_HEAD:-SIGNATURE_BYTES]


# ---- canonical encoding ----


class PayloadWriter:
    """Builds a canonical payload: fixed-width big-endian integers, length-prefixed
    strings."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, value: int) -> PayloadWriter:
        assert 0 <= value <= 0xFF, value
        self._parts.append(_U8.pack(value))
        return self

    def u64(self, value: int) -> PayloadWriter:
        assert 0 <= value < 1 << 64, value
        self._parts.append(_U64.pack(value))
        return self

    def text(self, value: str) -> PayloadWriter:
        raw = value.encode("utf-8")
        assert len(raw) <= STRING_BYTES_MAX, value
        self._parts.append(_U8.pack(len(raw)) + raw)
        return self

    def bytes(self) -> bytes:
        return b"".join(self._parts)


class PayloadReader:
    """Reads a canonical payload; every method raises MalformedPayload on bad input."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        self._at = 0

    def _take(self, count: int) -> bytes:
        end = self._at + count
        if end > len(self._payload):
            raise MalformedPayload("payload ends early")
        part = self._payload[self._at : end]
        self._at = end
        return part

    def u8(self) -> int:
        value: int = _U8.unpack(self._take(_U8.size))[0]
        return value

    def u64(self) -> int:
        value: int = _U64.unpack(self._take(_U64.size))[0]
        return value

    def text(self) -> str:
        raw = self._take(self.u8())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPayload("a string is not UTF-8") from None

    def finish(self) -> None:
        if self._at != len(self._payload):
            raise MalformedPayload(f"{len(self._payload) - self._at} bytes after the payload")
