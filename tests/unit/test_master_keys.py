"""The master's signing keys: which one signs, when a rotated one retires (tables of
the pure rules), and the keys over each metadata back end across restarts (a standby
taking over reads the same metadata), rotations, retirements and the records written
before keys rotated."""

from __future__ import annotations

import dataclasses

import pytest

from streamengine.master.catalog import Batch
from streamengine.master.core import keys
from streamengine.master.core.errors import ResourceExhausted
from streamengine.master.core.keys import KeyRecord
from streamengine.protocol.auth import Role
from streamengine.protocol.grants import Grant, GrantSigner, open_grant
from streamengine.protocol.signing import VERIFYING_KEYS_MAX, SignatureRefused, SigningKey
from streamengine.protocol.tokens import mint_token, open_token
from tests.metadata_backends import MetadataPlace
from tests.unit.test_master_state import Master

GRANT_MS = 10_000


def key_id(number: int) -> str:
    return f"{number:016x}"


FIRST = KeyRecord(key_id(1), created_at_ms=100)
PUBLISH = keys.KEY_PUBLISH_MS


@pytest.mark.parametrize(
    ("case", "signed_until", "retiring_at"),
    [
        ("no token signed: its grants last", 0, 1000 + PUBLISH + GRANT_MS),
        ("tokens expired before its grants", 5000, 1000 + PUBLISH + GRANT_MS),
        ("a token outlives its grants", 500_000, 500_000),
    ],
)
def test_a_rotated_key_retires_when_the_last_of_what_it_signed_expires(
    case: str, signed_until: int, retiring_at: int
) -> None:
    old = dataclasses.replace(FIRST, signed_until_ms=signed_until)
    superseded, added = keys.rotate([old], key_id(2), 1000, GRANT_MS)
    assert superseded.retiring_at_ms == retiring_at, case
    assert added == KeyRecord(key_id(2), 1000, signs_from_ms=1000 + PUBLISH)
    assert keys.due_to_retire([superseded, added], retiring_at - 1) == []
    assert keys.due_to_retire([superseded, added], retiring_at) == [key_id(1)]


@pytest.mark.parametrize(
    ("case", "now", "signing"),
    [
        ("before the rotation", 999, 1),
        ("while stores hear of the new key", 1000 + PUBLISH - 1, 1),
        ("once they have", 1000 + PUBLISH, 2),
        ("long after", 1 << 62, 2),
    ],
)
def test_a_new_key_signs_once_every_store_can_have_heard_of_it(
    case: str, now: int, signing: int
) -> None:
    records = keys.rotate([FIRST], key_id(2), 1000, GRANT_MS)
    assert keys.signing_key(records, now).key_id == key_id(signing), case


def test_a_token_the_old_key_signs_before_the_new_one_takes_over_holds_it_back() -> None:
    superseded, _ = keys.rotate([FIRST], key_id(2), 1000, GRANT_MS)
    late = keys.token_signed(superseded, 1 << 40)
    assert late.retiring_at_ms == 1 << 40
    assert keys.token_signed(late, 5000).signed_until_ms == 1 << 40  # never forward


def test_rotations_in_a_row_retire_oldest_first_and_list_newest_first() -> None:
    superseded, added = keys.rotate([FIRST], key_id(2), 1000, GRANT_MS)
    second_old, third = keys.rotate([superseded, added], key_id(3), 2000, GRANT_MS)
    records = [superseded, second_old, third]
    assert keys.signing_key(records, 2000 + PUBLISH).key_id == key_id(3)
    assert keys.due_to_retire(records, 1 << 62) == [key_id(1), key_id(2)]
    assert [r.key_id for r in keys.listing_order(records)] == [key_id(3), key_id(2), key_id(1)]


def test_a_rotation_past_what_a_verifier_holds_is_refused_naming_the_first_retirement() -> None:
    records = [FIRST]
    for number in range(2, VERIFYING_KEYS_MAX + 1):
        superseded, added = keys.rotate(records, key_id(number), number * 100, GRANT_MS)
        records = [r for r in records if r.key_id != superseded.key_id] + [superseded, added]
    assert len(records) == VERIFYING_KEYS_MAX
    first_retires = 200 + PUBLISH + GRANT_MS
    with pytest.raises(ResourceExhausted, match=f"first retires at {first_retires}"):
        keys.rotate(records, key_id(99), 5000, GRANT_MS)


# ---- the keys over a metadata back end ----


def test_rotated_keys_sign_verify_and_survive_a_restart(metadata_place: MetadataPlace) -> None:
    """Tokens and grants the old key signed verify after the rotation and after a
    restart on the same metadata (a standby taking over); new ones name the new key
    once stores can know it."""
    master = Master(metadata_place)
    state = master.state
    old_key = state.keys.signing(master.now)
    claims = state.issuer.create_token(
        "0123456789abcdef", "acme", int(Role.READ), 3600_000, master.now
    )
    old_token = mint_token(old_key, claims)
    grant = Grant(7, 1, "acme", "w1", (), master.now + state.grant_ms)
    old_grant = GrantSigner(old_key).sign(grant)
    added = state.keys.rotate(master.now)
    assert state.keys.public_keys()[1] == old_key.public_key
    assert state.keys.signing(master.now) is old_key  # stores hear of the new key first
    master.now += PUBLISH
    for restarted in (state, master.restart()):
        assert open_token(restarted.verifier, old_token) == claims
        assert open_grant(restarted.verifier, old_grant) == grant
        new_key = restarted.keys.signing(master.now)
        assert new_key.key_id.hex() == added.key_id != old_key.key_id.hex()
        assert restarted.keys.grant_signer(master.now).sign(grant)[4:12] == new_key.key_id
    listed = master.state.keys.listed()
    assert [r.key_id for r in listed] == [added.key_id, old_key.key_id.hex()]
    # The old key verifies until its token expires (an hour, beyond its grants).
    assert listed[1].retiring_at_ms == claims.expires_at_ms


def test_a_retired_key_verifies_nothing_and_stays_retired_after_a_restart(
    metadata_place: MetadataPlace,
) -> None:
    master = Master(metadata_place)
    state = master.state
    old_grant = state.keys.grant_signer(master.now).sign(Grant(7, 1, "acme", "w1", (), 1 << 62))
    state.keys.rotate(master.now)
    retiring_at = state.keys.listed()[1].retiring_at_ms
    assert state.keys.retire_due(retiring_at - 1) == []
    assert len(state.keys.retire_due(retiring_at)) == 1
    for restarted in (state, master.restart()):
        assert len(restarted.keys.public_keys()) == 1
        with pytest.raises(SignatureRefused, match="a key this cluster does not hold"):
            open_grant(restarted.verifier, old_grant)


def test_the_key_written_before_keys_rotated_becomes_the_first_key(
    metadata_place: MetadataPlace,
) -> None:
    """Every token it signed names its id already: they keep verifying."""
    catalog = metadata_place.open()
    old = SigningKey(bytes(range(32)))
    batch = Batch()
    batch.puts.append((b"m/signing_key", old.private_bytes))
    catalog.commit(batch)
    master = Master(metadata_place)
    assert master.state.keys.signing(master.now).public_key == old.public_key
    assert [(r.key_id, r.created_at_ms) for r in master.state.keys.listed()] == [
        (old.key_id.hex(), 0)
    ]
    loaded = master.restart().catalog.load()
    assert loaded.unrotated_signing_key is None
    assert list(loaded.signing_keys) == [old.key_id.hex()]
