"""RECOVERY-CASES.md's notation for a store's entries, so tables read like the traces.

`"e1@1 H@3 . BR@2"`: e1 (payload b"e1") written at epoch 1 at index 1, a HOLE of
epoch 3 at index 2, nothing at index 3, a BRIDGE of epoch 2 at index 4. `"-"` or `""`
is an empty store.
"""

from __future__ import annotations

from streamengine.protocol.entry import EntryKind, StoredEntry


def entries(notation: str) -> tuple[StoredEntry, ...]:
    out: list[StoredEntry] = []
    for index, word in enumerate(notation.split(), start=1):
        if word in (".", "-"):
            continue
        name, _, epoch_text = word.partition("@")
        epoch = int(epoch_text)
        if name == "H":
            out.append(StoredEntry.make(index, EntryKind.HOLE, epoch))
        elif name == "BR":
            out.append(StoredEntry.make(index, EntryKind.BRIDGE, epoch))
        else:
            out.append(StoredEntry.make(index, EntryKind.EVENT, epoch, name.encode()))
    return tuple(out)


def notation(held: tuple[StoredEntry, ...] | list[StoredEntry]) -> str:
    """The inverse of `entries`: what a store holds, in the traces' notation."""
    if not held:
        return "-"
    by_index = {e.index: e for e in held}
    words = []
    for index in range(1, max(by_index) + 1):
        e = by_index.get(index)
        if e is None:
            words.append(".")
        elif e.kind == EntryKind.HOLE:
            words.append(f"H@{e.epoch}")
        elif e.kind == EntryKind.BRIDGE:
            words.append(f"BR@{e.epoch}")
        else:
            words.append(f"{e.payload.decode()}@{e.epoch}")
    return " ".join(words)
