"""Listing streams a page at a time: which names a page holds, and the token that takes
a caller to the next one.

- **Name order.** Streams come sorted by their full name (`tenant/stream`); the shell
  keeps the names sorted (`MasterState.sorted_names`), so a page costs a bisection and
  its own rows, never the number of streams.
- **Filters.** A tenant selects the names under `tenant/`, a name prefix the names
  that start with it; both together select the names that satisfy both, which is one
  prefix again (the longer one) or none at all (`name_range`).
- **Tokens.** A page that is not the last hands out a token naming the last stream it
  held and the filter it was for; the next page starts after that name, so streams
  created or removed in between never shift a page. Callers treat it as opaque. A
  token that does not decode, or comes back with other filters, is refused
  (InvalidArgument) rather than guessed at.
- **Bounded pages.** At most `PAGE_STREAMS_MAX` streams a page; asking for 0 means
  that many, so a caller written before pages existed sees every stream of a cluster
  up to that size in one reply, and the first page beyond it.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from streamengine.master.core.errors import InvalidArgument
from streamengine.master.core.model import validate_name_part
from streamengine.protocol.limits import NAME_PART_CHARS_MAX

# Streams in one ListStreams reply: about 200 bytes each, so a page stays far below
# gRPC's 4 MiB message, and a page is served in milliseconds on the master's loop.
PAGE_STREAMS_MAX = 1000
# The longest name prefix worth asking for: a whole stream name.
NAME_PREFIX_CHARS_MAX = 2 * NAME_PART_CHARS_MAX + 1
# A token holds a version, a filter and a name: far below this once encoded.
PAGE_TOKEN_CHARS_MAX = 4 * (NAME_PREFIX_CHARS_MAX * 2 + 8)
_TOKEN_VERSION = "1"
_SEPARATOR = "\0"


@dataclass(frozen=True, slots=True)
class Page:
    names: tuple[str, ...]
    # Empty when this page is the last one.
    next_page_token: str


def name_range(tenant: str, name_prefix: str) -> str | None:
    """The one prefix every listed name starts with ("" for all), or None when the
    filters exclude each other. Raises InvalidArgument for a malformed filter."""
    if tenant:
        validate_name_part("tenant", tenant)
    if len(name_prefix) > NAME_PREFIX_CHARS_MAX:
        raise InvalidArgument(
            f"name prefix of {len(name_prefix)} characters: a stream name has at most "
            f"{NAME_PREFIX_CHARS_MAX}"
        )
    scope = f"{tenant}/" if tenant else ""
    if name_prefix.startswith(scope):
        return name_prefix
    if scope.startswith(name_prefix):
        return scope
    return None


def page_size(asked: int) -> int:
    """Streams a page holds; raises InvalidArgument above `PAGE_STREAMS_MAX`."""
    if not 0 <= asked <= PAGE_STREAMS_MAX:
        raise InvalidArgument(f"page size {asked}: at most {PAGE_STREAMS_MAX} streams a page")
    return asked or PAGE_STREAMS_MAX


def encode_page_token(prefix: str, last_name: str) -> str:
    assert last_name.startswith(prefix) and _SEPARATOR not in prefix + last_name
    raw = _SEPARATOR.join((_TOKEN_VERSION, prefix, last_name)).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_page_token(token: str, prefix: str) -> str:
    """The last name the page before held; raises InvalidArgument for a token that
    this master did not hand out for these filters."""
    if len(token) > PAGE_TOKEN_CHARS_MAX:
        raise InvalidArgument(f"page token of {len(token)} characters is not one of ours")
    try:
        parts = base64.urlsafe_b64decode(token.encode()).decode().split(_SEPARATOR)
    except (binascii.Error, UnicodeError, ValueError):
        raise InvalidArgument("page token does not decode: pass next_page_token as is") from None
    if len(parts) != 3 or parts[0] != _TOKEN_VERSION or not parts[2].startswith(parts[1]):
        raise InvalidArgument("page token is not one this master hands out")
    if parts[1] != prefix:
        raise InvalidArgument("page token was for other filters: ask with the same ones")
    return parts[2]


def list_page(
    sorted_names: Sequence[str], tenant: str, name_prefix: str, page_token: str, size: int
) -> Page:
    """The page of `sorted_names` (ascending, unique) these filters and token ask for."""
    prefix = name_range(tenant, name_prefix)
    size = page_size(size)
    if prefix is None:
        if page_token:
            raise InvalidArgument("page token was for other filters: ask with the same ones")
        return Page((), "")
    after = decode_page_token(page_token, prefix) if page_token else ""
    start = bisect.bisect_right(sorted_names, after) if after else 0
    start = max(start, bisect.bisect_left(sorted_names, prefix))
    names: list[str] = []
    for name in sorted_names[start : start + size + 1]:
        if not name.startswith(prefix):
            break
        names.append(name)
    more = len(names) > size
    names = names[:size]
    assert all(a < b for a, b in itertools.pairwise(names))
    assert not after or not names or names[0] > after
    return Page(tuple(names), encode_page_token(prefix, names[-1]) if more else "")
