"""The certificates of `netns-cluster.sh up-ha`, made in one process (a `streamengine
cert` run per certificate costs a second or more of start-up each).

    python deploy/netns_certs.py CERTS_DIR NAME:ROLE:ADDRESS...

makes the CA in CERTS_DIR/ca, for each NAME a dir CERTS_DIR/NAME with `ca.crt` and the
node certificate of ROLE (`master`, `etcd`, or `store`, whose store id is NAME) for
ADDRESS, and CERTS_DIR/client with `client.root` for the CLI.
"""

from __future__ import annotations

import sys
from pathlib import Path

from streamengine.protocol.private_files import write_private
from streamengine.protocol.transport import CA_CERT, ROOT_CLIENT
from streamengine.tools.certs import CA_KEY, create_ca, create_client, create_node


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root, nodes = Path(argv[0]), argv[1:]
    ca_key = root / "ca" / CA_KEY
    create_ca(root / "ca")
    ca = (root / "ca" / CA_CERT).read_bytes()
    for node in nodes:
        name, role, address = node.split(":")
        write_private(root / name / CA_CERT, ca)
        create_node(
            root / name,
            [address],
            master=role == "master",
            etcd=role == "etcd",
            store_id=name if role == "store" else "",
            ca_key_path=ca_key,
        )
    write_private(root / "client" / CA_CERT, ca)
    create_client(root / "client", ROOT_CLIENT, ca_key_path=ca_key)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
