"""The master's signatures: grants and tokens encode canonically, verify only as what
they are and only with the cluster's keys, and are verified once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest

from streamengine.protocol.auth import ANONYMOUS, INSECURE, Denial, Principal, PrincipalKind, Role
from streamengine.protocol.grants import (
    GRANT_MAGIC,
    Grant,
    GrantSegment,
    GrantSigner,
    open_grant,
)
from streamengine.protocol.signing import (
    MalformedPayload,
    NoVerifyingKey,
    PayloadWriter,
    SignatureRefused,
    SigningKey,
    Verifier,
)
from streamengine.protocol.tokens import (
    TOKEN_PREFIX,
    Revocations,
    TokenClaims,
    check_claims,
    mint_token,
    open_token,
    resolve_caller,
    token_envelope,
    token_text,
)

# Fixed keys: a test that fails names the same bytes every run.
KEY = SigningKey(bytes(range(32)))
OTHER_KEY = SigningKey(bytes(range(1, 33)))

GRANT = Grant(
    stream_id=7,
    epoch=5,
    tenant="acme",
    client_id="writer-1",
    segments=(
        GrantSegment(3, ("s1", "s2", "s3")),
        GrantSegment(4, ("s2", "s3", "s4")),
        GrantSegment(5, ("s4", "s5", "s1")),
    ),
    expires_at_ms=1_700_000_600_000,
    stream_name="acme/orders",
    write_quorum=2,
)
CLAIMS = TokenClaims("0123456789abcdef", "acme", Role.WRITE, 1_000, 61_000)


class CountingVerifier(Verifier):
    """Counts the signatures it actually checks."""

    def __init__(self, keys: list[bytes]) -> None:
        self.checked = 0
        super().__init__(keys)

    def _verify(self, magic: bytes, envelope: bytes) -> bytes:
        self.checked += 1
        return super()._verify(magic, envelope)


# ---- grants ----


def test_a_grant_round_trips_through_its_encoding_and_signature() -> None:
    assert Grant.decode(GRANT.encode()) == GRANT
    signed = GrantSigner(KEY).sign(GRANT)
    assert open_grant(Verifier([KEY.public_key]), signed) == GRANT


def test_equal_grants_sign_to_equal_bytes_and_are_signed_once() -> None:
    signer = GrantSigner(KEY)
    first = signer.sign(GRANT)
    again = signer.sign(dataclasses.replace(GRANT))
    assert first is again  # the cached bytes: no second signature
    assert KEY.sign(GRANT_MAGIC, GRANT.encode()) == first


def test_a_grant_without_a_segment_lists_only_the_unsealed_ones() -> None:
    grant = dataclasses.replace(GRANT, segments=GRANT.segments[:2])
    assert Grant.decode(grant.encode()).segment(5) is None
    assert Grant.decode(grant.encode()).segment(4) == GrantSegment(4, ("s2", "s3", "s4"))


def grant_payload(epoch: int, segments: list[tuple[int, list[str]]], tenant: str = "t") -> bytes:
    out = PayloadWriter().u64(7).u64(epoch).text(tenant).text("c").u8(len(segments))
    for segment_epoch, copy_set in segments:
        out.u64(segment_epoch).u8(len(copy_set))
        for store in copy_set:
            out.text(store)
    return out.bytes()


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


@pytest.mark.parametrize("at", [0, 4, 12, 20, 40, -1, -40])
def test_a_grant_changed_anywhere_is_refused(at: int) -> None:
    signed = GrantSigner(KEY).sign(GRANT)
    with pytest.raises(SignatureRefused):
        open_grant(Verifier([KEY.public_key]), flip(signed, at % len(signed)))


@pytest.mark.parametrize(
    ("case", "signed"),
    [
        ("signed by another key", GrantSigner(OTHER_KEY).sign(GRANT)),
        ("empty", b""),
        ("truncated", GrantSigner(KEY).sign(GRANT)[:-1]),
        ("a token's envelope", KEY.sign(b"SET1", CLAIMS.encode())),
        ("a grant's bytes under the token magic", KEY.sign(b"SET1", GRANT.encode())),
        ("oversized", b"SEG2" + b"\0" * 9000),
    ],
)
def test_forged_or_foreign_grants_are_refused(case: str, signed: bytes) -> None:
    with pytest.raises(SignatureRefused):
        open_grant(Verifier([KEY.public_key]), signed)


def test_a_token_already_verified_is_still_no_grant() -> None:
    """The cache holds what a verifier opened, whatever its kind: a token's envelope it
    verified once, shown again as a grant, must be refused, not returned as claims."""
    verifier = Verifier([KEY.public_key])
    token = mint_token(KEY, CLAIMS)
    assert open_token(verifier, token) == CLAIMS
    with pytest.raises(SignatureRefused, match="another purpose"):
        open_grant(verifier, token_envelope(token))


def test_a_grant_already_verified_is_still_no_token() -> None:
    verifier = Verifier([KEY.public_key])
    signed = GrantSigner(KEY).sign(GRANT)
    assert open_grant(verifier, signed) == GRANT
    with pytest.raises(SignatureRefused, match="another purpose"):
        open_token(verifier, token_text(signed))


def test_a_verifier_without_keys_refuses_as_not_knowing_yet() -> None:
    with pytest.raises(NoVerifyingKey):
        open_grant(Verifier(), GrantSigner(KEY).sign(GRANT))


def test_a_correctly_signed_but_malformed_grant_is_refused() -> None:
    payload = GRANT.encode() + b"\0"  # trailing bytes: not canonical
    with pytest.raises(SignatureRefused, match="malformed"):
        open_grant(Verifier([KEY.public_key]), KEY.sign(GRANT_MAGIC, payload))


@pytest.mark.parametrize(
    ("case", "payload"),
    [
        ("segments out of order", grant_payload(5, [(4, ["s1"]), (3, ["s1"])])),
        ("a segment after the epoch", grant_payload(5, [(6, ["s1"])])),
        ("a store twice", grant_payload(5, [(5, ["s1", "s1"])])),
        ("an empty copy set", grant_payload(5, [(5, [])])),
        ("more segments than a grant lists", grant_payload(5, [(e, ["s1"]) for e in range(1, 6)])),
        ("no tenant", grant_payload(5, [], tenant="")),
        ("cut short", GRANT.encode()[:-3]),
        ("a byte too many", GRANT.encode() + b"\0"),
    ],
)
def test_decoding_refuses_what_no_grant_encodes_to(case: str, payload: bytes) -> None:
    with pytest.raises(MalformedPayload):
        Grant.decode(payload)


def test_a_grant_is_verified_once_however_often_it_is_shown() -> None:
    verifier = CountingVerifier([KEY.public_key])
    signed = GrantSigner(KEY).sign(GRANT)
    for _ in range(100):
        assert open_grant(verifier, bytes(signed)) == GRANT
    assert verifier.checked == 1


def test_the_cache_is_bounded_and_forgets_the_oldest() -> None:
    verifier = Verifier([KEY.public_key], cache_max=2)
    signer = GrantSigner(KEY)
    grants = [dataclasses.replace(GRANT, epoch=e, segments=()) for e in (5, 6, 7)]
    for grant in grants:
        open_grant(verifier, signer.sign(grant))
    counting = CountingVerifier([KEY.public_key])
    counting._cache = verifier._cache  # the same cache: what is still in it?
    open_grant(counting, signer.sign(grants[2]))
    assert counting.checked == 0
    open_grant(counting, signer.sign(grants[0]))
    assert counting.checked == 1


def test_dropping_a_key_drops_what_it_signed_from_the_cache() -> None:
    verifier = Verifier([KEY.public_key, OTHER_KEY.public_key])
    old = GrantSigner(OTHER_KEY).sign(GRANT)
    assert open_grant(verifier, old) == GRANT
    verifier.set_keys([KEY.public_key])
    with pytest.raises(SignatureRefused):
        open_grant(verifier, old)


def test_a_rotated_key_is_accepted_beside_the_old_one() -> None:
    verifier = Verifier([KEY.public_key, OTHER_KEY.public_key])
    assert open_grant(verifier, GrantSigner(KEY).sign(GRANT)) == GRANT
    assert open_grant(verifier, GrantSigner(OTHER_KEY).sign(GRANT)) == GRANT


def test_a_new_key_differs_and_verifies_its_own_signatures() -> None:
    made = SigningKey.generate()
    assert made.public_key != KEY.public_key
    assert open_grant(Verifier([made.public_key]), GrantSigner(made).sign(GRANT)) == GRANT


# ---- tokens ----


def test_a_token_round_trips_and_names_its_tenant_and_role() -> None:
    token = mint_token(KEY, CLAIMS)
    assert token.startswith(TOKEN_PREFIX)
    assert open_token(Verifier([KEY.public_key]), token) == CLAIMS
    principal = CLAIMS.principal()
    assert (principal.kind, principal.tenant, principal.role) == (
        PrincipalKind.TENANT,
        "acme",
        Role.WRITE,
    )


@pytest.mark.parametrize(
    ("case", "token"),
    [
        ("another cluster's", mint_token(OTHER_KEY, CLAIMS)),
        ("no prefix", mint_token(KEY, CLAIMS)[len(TOKEN_PREFIX) :]),
        ("not base64", TOKEN_PREFIX + "!!!!"),
        ("a grant as a token", TOKEN_PREFIX + "U0VHMQ"),
        ("changed role", mint_token(KEY, CLAIMS)[:-8] + "AAAAAAAA"),
        ("huge", TOKEN_PREFIX + "A" * 20000),
    ],
)
def test_foreign_or_changed_tokens_are_refused(case: str, token: str) -> None:
    with pytest.raises(SignatureRefused):
        open_token(Verifier([KEY.public_key]), token)


@pytest.mark.parametrize(
    ("now_ms", "revoked", "refusal"),
    [
        (1_000, (), None),
        (60_999, (), None),
        (61_000, (), "expired"),
        (30_000, ("0123456789abcdef",), "revoked"),
        (30_000, ("fedcba9876543210",), None),
    ],
)
def test_expiry_and_revocation(now_ms: int, revoked: tuple[str, ...], refusal: str | None) -> None:
    revocations = Revocations({token_id: 61_000 for token_id in revoked}, version=1)
    denial = check_claims(CLAIMS, now_ms, revocations)
    assert (denial is None) == (refusal is None)
    if denial is not None and refusal is not None:
        assert refusal in denial.reason


def test_revocations_are_forgotten_once_their_tokens_expire() -> None:
    revocations = Revocations({"a" * 16: 100, "b" * 16: 200}, version=3)
    revocations.prune(150)
    assert revocations.items() == [("b" * 16, 200)]
    assert revocations.version == 3


MEMBER = Principal(PrincipalKind.STORE, "s1")
ADMIN = Principal(PrincipalKind.CLUSTER_ADMIN, "root")
VALID = mint_token(KEY, CLAIMS)
EXPIRED_AT = 61_000


@pytest.mark.parametrize(
    ("identity", "bearer", "now_ms", "expected"),
    [
        # Plaintext servers: a caller without a token is allowed everything, as before.
        (INSECURE, None, 0, INSECURE),
        # A caller that shows a token is held to it, on any server.
        (INSECURE, VALID, 2_000, CLAIMS.principal()),
        # Over TLS without a certificate proof: anonymous until a token says more.
        (ANONYMOUS, None, 0, ANONYMOUS),
        (ANONYMOUS, VALID, 2_000, CLAIMS.principal()),
        # Certificates of members and admins prove more than a token.
        (MEMBER, VALID, 2_000, MEMBER),
        (ADMIN, None, 0, ADMIN),
        # Bad tokens are refused, never treated as no token.
        (INSECURE, VALID, EXPIRED_AT, "expired"),
        (ANONYMOUS, mint_token(OTHER_KEY, CLAIMS), 2_000, "not valid"),
        (INSECURE, "garbage", 0, "not valid"),
    ],
)
def test_resolve_caller(
    identity: Principal, bearer: str | None, now_ms: int, expected: Principal | str
) -> None:
    got = resolve_caller(identity, bearer, Verifier([KEY.public_key]), Revocations(), now_ms)
    if isinstance(expected, str):
        assert isinstance(got, Denial) and expected in got.reason
    else:
        assert got == expected


def test_a_revoked_token_resolves_to_a_denial() -> None:
    revocations = Revocations({CLAIMS.token_id: CLAIMS.expires_at_ms}, version=1)
    got = resolve_caller(INSECURE, VALID, Verifier([KEY.public_key]), revocations, 2_000)
    assert isinstance(got, Denial) and "revoked" in got.reason


def test_a_token_that_cannot_be_checked_yet_is_not_a_bad_token() -> None:
    with pytest.raises(NoVerifyingKey):
        resolve_caller(INSECURE, VALID, Verifier(), Revocations(), 2_000)


def test_a_token_limited_to_streams_round_trips_and_one_made_before_still_opens() -> None:
    limited = dataclasses.replace(CLAIMS, role=Role.READ, stream_ids=(3, 7))
    verifier = Verifier([KEY.public_key])
    opened = open_token(verifier, mint_token(KEY, limited))
    assert opened == limited and opened.principal().stream_ids == (3, 7)
    # A token of the format before tokens named streams: every stream of its tenant.
    before = KEY.sign(b"SET1", CLAIMS.encode()[:-1])  # without the stream count
    assert open_token(verifier, token_text(before)) == CLAIMS


@pytest.mark.parametrize(
    ("case", "streams"),
    [("out of order", (7, 3)), ("twice", (3, 3)), ("stream 0", (0,)), ("too many", range(1, 66))],
)
def test_a_token_naming_streams_badly_is_refused(case: str, streams: Iterable[int]) -> None:
    ids = list(streams)
    payload = CLAIMS.encode()[:-1] + bytes([len(ids)]) + b"".join(i.to_bytes(8, "big") for i in ids)
    with pytest.raises(SignatureRefused, match="malformed token claims"):
        open_token(Verifier([KEY.public_key]), token_text(KEY.sign(b"SET2", payload)))
