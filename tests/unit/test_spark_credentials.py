"""What a Spark writer hands its executors, and which driver tokens it refuses before
any task runs (`client.spark`, "Secured clusters (writing)")."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamengine.client.errors import InvalidArgument
from streamengine.client.spark import _Credentials
from streamengine.protocol.auth import Role
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.tokens import TokenClaims, mint_token, unverified_claims
from streamengine.protocol.transport import PLAINTEXT

KEY = SigningKey.generate()
STREAM = "acme/orders"


def token(role: Role, tenant: str = "acme", stream_ids: tuple[int, ...] = ()) -> str:
    claims = TokenClaims("0123456789abcdef", tenant, role, 1, 2, stream_ids)
    return mint_token(KEY, claims)


def credentials(tmp_path: Path, **options: str) -> _Credentials:
    (tmp_path / "ca.crt").write_bytes(b"the cluster's CA")
    return _Credentials({"certsdir": str(tmp_path), **options})


def test_a_token_says_its_own_claims_unverified() -> None:
    claims = unverified_claims(token(Role.READ, stream_ids=(7,)))
    assert (claims.tenant, claims.role, claims.stream_ids) == ("acme", Role.READ, (7,))


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"token": token(Role.READ)}, "option token: a read token cannot write acme/orders"),
        ({"token": token(Role.WRITE, "other")}, "a token of tenant other cannot write"),
        ({"token": "se1_garbage!"}, "option token: "),
        ({"token": token(Role.ADMIN), "executortoken": token(Role.READ)}, "executorToken"),
    ],
)
def test_a_driver_whose_token_cannot_write_the_stream_is_refused(
    tmp_path: Path, options: dict[str, str], refusal: str
) -> None:
    with pytest.raises(InvalidArgument, match=refusal):
        credentials(tmp_path, **options).check_writes(STREAM)


def test_a_tenant_driver_hands_its_write_token_on_with_the_ca_and_no_key(tmp_path: Path) -> None:
    write = token(Role.WRITE)
    given = credentials(tmp_path, token=write)
    given.check_writes(STREAM)
    transport = given.writers("master:7070", STREAM)
    ca = b"the cluster's CA"
    assert (transport.ca_pem, transport.token, transport.cert_pem) == (ca, write, b"")


def test_an_executor_token_goes_instead_of_the_drivers(tmp_path: Path) -> None:
    driver, executors = token(Role.ADMIN), token(Role.WRITE)
    given = credentials(tmp_path, token=driver, executortoken=executors)
    given.check_writes(STREAM)
    assert given.writers("master:7070", STREAM).token == executors


def test_a_plaintext_driver_writes_in_plaintext() -> None:
    given = _Credentials({})
    given.check_writes(STREAM)
    assert given.writers("master:7070", STREAM) == PLAINTEXT
