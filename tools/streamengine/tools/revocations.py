"""`streamengine cert revoke|list-revoked`: certificates refused before they expire.

`revoke` names what it revokes (a serial from the CA's `ca.issued`, or a certificate
file the cluster's CA signed) and, with `--yes`, asks the active master to record it:
every server refuses the certificate from then on (the master at once, each store at
its next heartbeat), until the certificate expires. Irreversible: a certificate revoked
by mistake is replaced by a new one (`cert create-*`).
"""

from __future__ import annotations

import argparse
import time

from streamengine.client.errors import InvalidArgument
from streamengine.protocol import codec
from streamengine.protocol.cert_revocations import RevokedCert, serial_text
from streamengine.tools.certs import CertError, revocation_target
from streamengine.tools.ops import RPC_TIMEOUT_S, client_transport, master_stub
from streamengine.v1 import master_pb2


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000))


def describe(entry: RevokedCert) -> str:
    name = f" ({entry.common_name})" if entry.common_name else ""
    return f"serial {serial_text(entry.serial)}{name}, expires {_utc(entry.not_after_ms)}"


def cmd_revoke(args: argparse.Namespace) -> int:
    if args.certs_dir is None:
        raise InvalidArgument("cert revoke: give the admin's certs dir (--certs-dir)")
    try:
        entry = revocation_target(args.certificate, args.certs_dir, args.ca_key)
    except CertError as error:
        raise InvalidArgument(str(error)) from None
    if not args.yes:
        print(f"would revoke the certificate {describe(entry)}: every server refuses it")
        print("nothing changed; add --yes to revoke (irreversible)")
        return 1
    request = master_pb2.RevokeCertificateRequest(certificate=codec.revoked_cert_to_pb(entry))
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.RevokeCertificate(request, timeout=RPC_TIMEOUT_S)
    if not reply.revoked:
        print(f"the certificate {describe(entry)} was revoked already")
        return 0
    print(f"revoked the certificate {describe(entry)}; stores refuse it within a heartbeat")
    return 0


def cmd_list_revoked(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.ListRevokedCertificates(
            master_pb2.ListRevokedCertificatesRequest(), timeout=RPC_TIMEOUT_S
        )
    for message in reply.certificates:
        entry = codec.revoked_cert_from_pb(message)
        print(f"{describe(entry)}, revoked {_utc(entry.revoked_at_ms)}")
    if not reply.certificates:
        print("no certificate revoked")
    return 0
