"""Listing streams a page at a time (`streamengine.master.core.listing`): filters,
pages and tokens as tables, then paging through against a naive twin."""

from __future__ import annotations

import random

import pytest

from streamengine.master.core import listing
from streamengine.master.core.errors import InvalidArgument

NAMES = sorted(["a/x", "a/y", "ab/x", "b/s1", "b/s2", "b/s3", "b/t1", "c/z"])


def everything(tenant: str, prefix: str, size: int) -> list[tuple[str, ...]]:
    """Every page, in order, by following the tokens."""
    pages, token = [], ""
    while True:
        page = listing.list_page(NAMES, tenant, prefix, token, size)
        pages.append(page.names)
        if not page.next_page_token:
            return pages
        token = page.next_page_token


@pytest.mark.parametrize(
    ("rule", "tenant", "prefix", "expected"),
    [
        ("no filter: every stream", "", "", NAMES),
        ("a tenant: its streams only, not a tenant its name starts", "a", "", ["a/x", "a/y"]),
        ("a prefix of the full name", "", "b/s", ["b/s1", "b/s2", "b/s3"]),
        ("a prefix across tenants", "", "a", ["a/x", "a/y", "ab/x"]),
        ("tenant and prefix: both hold", "b", "b/s", ["b/s1", "b/s2", "b/s3"]),
        ("a prefix shorter than the tenant", "b", "b", ["b/s1", "b/s2", "b/s3", "b/t1"]),
        ("filters that exclude each other", "a", "b/", []),
        ("a tenant with no stream", "d", "", []),
    ],
)
def test_a_listing_holds_the_streams_its_filters_select_in_name_order(
    rule, tenant, prefix, expected
) -> None:
    assert [n for page in everything(tenant, prefix, 0) for n in page] == expected, rule


@pytest.mark.parametrize(
    ("rule", "size", "pages"),
    [
        ("pages of two, the last short", 2, [("b/s1", "b/s2"), ("b/s3", "b/t1")]),
        ("pages of three", 3, [("b/s1", "b/s2", "b/s3"), ("b/t1",)]),
        ("a page exactly full is the last: no token", 4, [("b/s1", "b/s2", "b/s3", "b/t1")]),
        ("0 means the most a page holds", 0, [("b/s1", "b/s2", "b/s3", "b/t1")]),
    ],
)
def test_pages_follow_each_other_by_token(rule, size, pages) -> None:
    assert everything("b", "", size) == pages, rule


def test_a_page_starts_after_the_last_name_whatever_was_created_or_removed() -> None:
    first = listing.list_page(NAMES, "b", "", "", 2)
    assert first.names == ("b/s1", "b/s2")
    changed = sorted({*NAMES, "b/a0", "b/s10", "b/s25"} - {"b/s2"})
    second = listing.list_page(changed, "b", "", first.next_page_token, 2)
    assert second.names == ("b/s25", "b/s3"), "those sorting before the page are not seen"


@pytest.mark.parametrize(
    ("rule", "tenant", "prefix", "token", "size"),
    [
        ("a page too large", "", "", "", listing.PAGE_STREAMS_MAX + 1),
        ("a malformed tenant", "..x", "", "", 0),
        ("a prefix longer than any name", "", "a" * (listing.NAME_PREFIX_CHARS_MAX + 1), "", 0),
        ("a token that is not base64", "", "", "%%%", 0),
        ("a token of random bytes", "", "", "AAECAwQ=", 0),
        ("a token far too long", "", "", "A" * (listing.PAGE_TOKEN_CHARS_MAX + 4), 0),
        ("a token for another tenant", "a", "", listing.encode_page_token("b/", "b/s1"), 0),
        ("a token for another prefix", "", "b/s", listing.encode_page_token("b/", "b/s1"), 0),
        ("a token with filters that now select nothing", "a", "b/", "MQBhLwBhL3g=", 0),
    ],
)
def test_bad_pages_and_tokens_are_refused(rule, tenant, prefix, token, size) -> None:
    with pytest.raises(InvalidArgument):
        listing.list_page(NAMES, tenant, prefix, token, size)


def test_paging_matches_a_naive_twin() -> None:
    rng = random.Random(38)
    for _ in range(200):
        names = sorted({f"t{rng.randrange(3)}/s{rng.randrange(30)}" for _ in range(40)})
        tenant = rng.choice(["", "t0", "t1", "t9"])
        prefix = rng.choice(["", "t", "t1", "t1/", "t1/s1", "t2/s"])
        size = rng.randrange(1, 12)
        scope = f"{tenant}/" if tenant else ""
        expected = [n for n in names if n.startswith(prefix) and n.startswith(scope)]
        seen: list[str] = []
        token = ""
        for _ in range(len(names) + 1):
            page = listing.list_page(names, tenant, prefix, token, size)
            assert len(page.names) <= size
            seen += page.names
            token = page.next_page_token
            if not token:
                break
        assert seen == expected, (tenant, prefix, size)
