"""The master's signing keys: made, rotated, retired, and the key set verifiers hold.

The rules are `core.keys`; this section keeps the records (`catalog`, y/ records, each
with its private key) and the objects that sign and verify with them: `signing(now)`
and `grant_signer(now)` sign with the key that signs then, `verifier` verifies with
every key not retired, and `public_keys` is what stores are told. A section of the
master's state (`master.state`).

Keys made before keys rotated: the one `m/signing_key` record becomes the first key
(created at 0: when is not known), in one transaction with its removal. Its id is the
one every envelope it signed names already (the id is derived from the public key and
has been in every envelope since the first), so every token and grant it signed keeps
verifying, and nothing is refused for naming no key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch, Loaded
from streamengine.master.core import keys
from streamengine.master.core.keys import KeyRecord
from streamengine.protocol.grants import GrantSigner
from streamengine.protocol.signing import SigningKey, Verifier

if TYPE_CHECKING:
    from streamengine.master.state import MasterState


class SigningKeys:
    """The keys that sign and verify, and their records."""

    def __init__(
        self, state: MasterState, loaded: Loaded, make_key: Callable[[], SigningKey], now_ms: int
    ) -> None:
        self.state = state
        self.make_key = make_key
        self.records: dict[str, KeyRecord] = {}
        self.private: dict[str, SigningKey] = {}
        # One per key (each signs each distinct grant once).
        self._grant_signers: dict[str, GrantSigner] = {}
        for key_id, (record, private_bytes) in loaded.signing_keys.items():
            self._keep(record, SigningKey(private_bytes))
            assert self.private[key_id].key_id.hex() == key_id, key_id
        if loaded.unrotated_signing_key is not None:
            self._adopt_unrotated(SigningKey(loaded.unrotated_signing_key))
        elif not self.records:
            key = make_key()
            record = KeyRecord(key.key_id.hex(), now_ms)
            state.catalog.commit(Batch().signing_key(record, key.private_bytes))
            self._keep(record, key)
        self.verifier = Verifier(self.public_keys())

    def _adopt_unrotated(self, key: SigningKey) -> None:
        """The key kept before keys rotated becomes the first y/ record (module doc).
        Beside y/ records (a backup of that time restored over them) it is dropped:
        the rotated keys are the truth."""
        batch = Batch().drop_unrotated_signing_key()
        if not self.records:
            record = KeyRecord(key.key_id.hex(), 0)
            batch.signing_key(record, key.private_bytes)
            self._keep(record, key)
        self.state.catalog.commit(batch)

    def _keep(self, record: KeyRecord, key: SigningKey) -> None:
        self.records[record.key_id] = record
        self.private[record.key_id] = key

    def signing(self, now_ms: int) -> SigningKey:
        """The key grants and tokens are signed with at `now_ms`."""
        return self.private[keys.signing_key(self.records.values(), now_ms).key_id]

    def grant_signer(self, now_ms: int) -> GrantSigner:
        """Signs grants with the key that signs at `now_ms`."""
        key_id = keys.signing_key(self.records.values(), now_ms).key_id
        signer = self._grant_signers.get(key_id)
        if signer is None:
            signer = self._grant_signers[key_id] = GrantSigner(self.private[key_id])
        return signer

    def listed(self) -> list[KeyRecord]:
        return keys.listing_order(self.records.values())

    def public_keys(self) -> list[bytes]:
        """Every key not retired, newest first (what stores are told)."""
        return [self.private[record.key_id].public_key for record in self.listed()]

    def rotate(self, now_ms: int) -> KeyRecord:
        """Add a key that signs from `core.keys.KEY_PUBLISH_MS` on; returns its record.
        Raises ResourceExhausted (`core.keys.rotate`)."""
        key = self.make_key()
        superseded, added = keys.rotate(
            list(self.records.values()), key.key_id.hex(), now_ms, self.state.grant_ms
        )
        old = self.private[superseded.key_id]
        batch = Batch().signing_key(superseded, old.private_bytes)
        self.state.catalog.commit(batch.signing_key(added, key.private_bytes))
        self.records[superseded.key_id] = superseded
        self._keep(added, key)
        self.verifier.set_keys(self.public_keys())
        return added

    def retire_due(self, now_ms: int) -> list[str]:
        """Retire the keys all of whose signatures have expired; their ids."""
        due = keys.due_to_retire(self.records.values(), now_ms)
        if not due:
            return []
        batch = Batch()
        for key_id in due:
            batch.drop_signing_key(key_id)
        self.state.catalog.commit(batch)
        for key_id in due:
            del self.records[key_id]
            del self.private[key_id]
            self._grant_signers.pop(key_id, None)
        self.verifier.set_keys(self.public_keys())
        return due

    def token_signed(self, batch: Batch, now_ms: int, expires_at_ms: int) -> KeyRecord:
        """Add to `batch` that the key signing at `now_ms` signs a token expiring at
        `expires_at_ms`; `kept` the returned record once the batch is committed."""
        signing = keys.signing_key(self.records.values(), now_ms)
        record = keys.token_signed(signing, expires_at_ms)
        batch.signing_key(record, self.private[record.key_id].private_bytes)
        return record

    def kept(self, record: KeyRecord) -> None:
        assert record.key_id in self.records, record
        self.records[record.key_id] = record
