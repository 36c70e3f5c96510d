"""`streamengine`: run servers and operate a cluster.

Exit codes: 0 ok, 1 failure, 2 usage. Expected failures print one line, never a
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Runner = Callable[[argparse.Namespace], int]


def _add_server_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from master import server as master_server
    from segment_store import server as store_server

    master = commands.add_parser("master", help="run the master", description=master_server.__doc__)
    master_server.add_arguments(master)
    master.set_defaults(run=master_server.run)

    store = commands.add_parser(
        "store", help="run a segment store", description=store_server.__doc__
    )
    store_server.add_arguments(store)
    store.set_defaults(run=store_server.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamengine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_server_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if not __debug__:
        print("streamengine: refusing to run under python -O (assertions guard invariants)")
        return 2
    args = build_parser().parse_args(argv)
    run: Runner = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
