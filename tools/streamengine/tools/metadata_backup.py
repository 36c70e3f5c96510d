"""`streamengine metadata backup|restore`: the master's records, copied out and back in.

A backup is every record of the master's metadata as of one moment, in a file that
does not care where it came from: the embedded RocksDB under a master's `--data` (read
as a RocksDB secondary instance, so the master may keep running) or etcd (one read at
one revision). A restore writes such a file into an empty metadata store of either
kind, so it also moves a cluster from the embedded store to etcd. It refuses a store
that holds records, and etcd while any master is in the election: stop every master
first. A backup older than the last grant comes back with `--raise-epochs N`, so that no
epoch granted after it is granted again (deploy/README.md).

File format, JSON lines: a header `{"format": "streamengine-metadata", "version": 1,
"records": N}`, then one `{"k": base64, "v": base64}` per record in key order, then
`{"end": N, "sha256": hex}` over the record lines.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
from pathlib import Path

from streamengine.client.errors import InvalidArgument, StreamEngineError, Unavailable
from streamengine.master.catalog import raise_epochs
from streamengine.master.core.errors import MasterError
from streamengine.master.etcd import EtcdClient, EtcdTLS, parse_etcd_url
from streamengine.master.etcd_metadata import EtcdMetadata, NoMasterGuard
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX, Metadata, Transaction
from streamengine.master.rocksdb_metadata import RocksDBMetadata, snapshot_records
from streamengine.protocol.private_files import write_private
from streamengine.protocol.transport import TransportError

FORMAT = "streamengine-metadata"
VERSION = 1


def _record_line(key: bytes, value: bytes) -> str:
    return json.dumps({"k": base64.b64encode(key).decode(), "v": base64.b64encode(value).decode()})


def write_backup(records: list[tuple[bytes, bytes]], path: Path) -> str:
    """Write `records` to `path`, readable by its owner only (it holds the master's
    signing key), through a temporary file renamed when complete; returns the
    checksum."""
    digest = hashlib.sha256()
    lines = [json.dumps({"format": FORMAT, "version": VERSION, "records": len(records)}) + "\n"]
    for key, value in records:
        line = _record_line(key, value) + "\n"
        digest.update(line.encode())
        lines.append(line)
    lines.append(json.dumps({"end": len(records), "sha256": digest.hexdigest()}) + "\n")
    write_private(path, "".join(lines).encode())
    return digest.hexdigest()


def read_backup(path: Path) -> list[tuple[bytes, bytes]]:
    """The records of a backup file; raises InvalidArgument if it is not a whole one."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise InvalidArgument(f"cannot read {path}: {error}") from None
    try:
        header, footer = json.loads(lines[0]), json.loads(lines[-1])
        body = lines[1:-1]
        records = [
            (base64.b64decode(row["k"]), base64.b64decode(row["v"]))
            for row in map(json.loads, body)
        ]
    except (IndexError, ValueError, KeyError, TypeError):
        raise InvalidArgument(f"{path} is not a metadata backup") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise InvalidArgument(f"{path}: not a {FORMAT} version {VERSION} file")
    digest = hashlib.sha256("".join(line + "\n" for line in body).encode()).hexdigest()
    if footer.get("end") != len(records) or header.get("records") != len(records):
        raise InvalidArgument(f"{path} is truncated")
    if footer.get("sha256") != digest:
        raise InvalidArgument(f"{path} is damaged (checksum)")
    return records


def _etcd(url: str, certs_dir: Path | None) -> EtcdMetadata:
    try:
        tls = None if certs_dir is None else EtcdTLS.from_certs_dir(certs_dir)
        return EtcdMetadata(EtcdClient(parse_etcd_url(url), tls))
    except MasterError as error:
        raise InvalidArgument(f"--metadata: {error}") from None
    except TransportError as error:
        raise InvalidArgument(str(error)) from None


def cmd_backup(args: argparse.Namespace) -> int:
    try:
        if args.data is not None:
            records = snapshot_records(args.data)
        else:
            metadata = _etcd(args.metadata, args.certs_dir)
            try:
                records = metadata.read_all()
            finally:
                metadata.close()
    except FileNotFoundError as error:
        raise InvalidArgument(str(error)) from None
    except MasterError as error:
        raise Unavailable(f"cannot read the metadata: {error}") from None
    checksum = write_backup(records, args.to)
    print(f"{len(records)} records written to {args.to} (sha256 {checksum})")
    return 0


def restore_records(
    metadata: Metadata, records: list[tuple[bytes, bytes]], epochs_raised_by: int = 0
) -> None:
    """Write `records` into `metadata`, which must hold none, in transactions of at most
    OPS_PER_TRANSACTION_MAX records, every stream's latest epoch raised by
    `epochs_raised_by` (see `catalog.raise_epochs`)."""
    try:
        records = raise_epochs(records, epochs_raised_by)
    except MasterError as error:
        raise InvalidArgument(str(error)) from None
    if metadata.read_all():
        raise InvalidArgument("the target metadata is not empty: restore only into an empty one")
    for start in range(0, len(records), OPS_PER_TRANSACTION_MAX):
        metadata.commit(Transaction(puts=records[start : start + OPS_PER_TRANSACTION_MAX]))


def cmd_restore(args: argparse.Namespace) -> int:
    records = read_backup(args.source)
    try:
        if args.data is not None:
            try:
                embedded = RocksDBMetadata(args.data)
            except Exception as error:  # rocksdict: the master holds the lock, or no access
                raise Unavailable(
                    f"cannot open {args.data} (is a master running?): {error}"
                ) from None
            try:
                restore_records(embedded, records, args.raise_epochs)
            finally:
                embedded.close()
        else:
            metadata = _etcd(args.metadata, args.certs_dir)
            # Every transaction compares that no master is in the election.
            metadata.guard = NoMasterGuard()
            try:
                restore_records(metadata, records, args.raise_epochs)
            finally:
                metadata.close()
    except StreamEngineError:
        raise
    except MasterError as error:
        raise Unavailable(f"restore stopped: {error}") from None
    print(f"{len(records)} records restored from {args.source}")
    return 0
