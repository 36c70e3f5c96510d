"""The operator's read side in the world on the runtime: what an operator and a
dashboard read all along a run, beside the operator's trims, deletes and drains.

In half the world's operator seeds (`WorldConfig.read_side`, drawn from a generator of
its own, as are its calls: `random.Random(f"{seed}/read-side-calls")`, so that the
world's draws stay where they were), every few hundred ms of the safety phase one of:

- `streamengine stream create` of a stream of its own (`d0/x1`, `d1/x2`, ...: tenants
  no writer or follower of the world touches, names never used twice), a few at once
  (`create_streams`), one of its own again (answered as it stands), `tenant create`,
  `stream delete --yes` of one (left to the master's grace, so that it is removed
  within the run), or `stream undelete`;
- `streamengine stream list` walked a page at a time (`StreamClient.list_streams`,
  pages of 1-3 streams, by tenant, by name prefix, both, or neither) while those
  streams come and go;
- `streamengine seal NAME` of one of the world's streams;
- `streamengine stream describe`, `status --json` (GetClusterStatus through
  `status_view.status_dict`), and the console's `/api/status` and `/metrics`
  (`console.console_reply` on the view the master's gauges loop published, as its
  HTTP thread answers a browser; a standby's console says only that it stands by);
- `streamengine token create` of a read token for a tenant, `key list` (now and then
  `key rotate`: the master's next key signs once every store can have heard of it),
  and the tenants listed; `drain --dry-run` and `rebalance --dry-run`; listings the
  master must refuse (invariant 6);

each as the cluster admin or as a tenant's token (the read tokens it made, and, in
the world's token seeds, the write tokens of `TOKEN_TENANT` whose process was not
revoked). Every answer goes to `checkers.CatalogChecker` (invariant 16) with the
serving master's streams looked at just before and just after it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from streamengine import StreamClient
from streamengine.client.errors import NotFound, PermissionDenied, StreamEngineError
from streamengine.master.console import console_reply
from streamengine.master.core import listing
from streamengine.master.core.summary import STATUS_STREAMS_MAX
from streamengine.protocol.auth import INSECURE
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.status_view import status_dict
from streamengine.v1 import master_pb2
from tests.sim.checkers import CatalogChecker, Shown, Violation
from tests.sim.runtime.master import SimElectedMaster, SimMaster

if TYPE_CHECKING:
    from tests.sim.runtime.world import World

T = TypeVar("T")

# How often the read side acts (at most), and how long one action may take (a walk
# of several pages, each retried through a master's restart).
READ_EVERY_MS = 300
ACTION_S_MAX = 10.0
CALL_S = 2.0
# How long `seal` waits for a leader's roll (or its own recovery).
SEAL_S = 5.0
# Its own streams: under tenants nobody else writes or follows, at most this many.
TENANTS = ("d0", "d1")
CREATED_MAX = 12
# What a walk filters by (a prefix within its tenant, or any; now and then filters
# that exclude each other) and how many streams a page holds (0: the master's most).
TENANT_FILTERS = ("t0", "t1", "t2", *TENANTS)
PREFIXES_WITHIN = ("/", "/s1", "/x1", "/s")
PREFIXES = ("t", "d", "t1/s1", "d0/x1", "d1/", "x")
PAGE_SIZES = (1, 1, 2, 3, 0)
# A dashboard draws a row in up to this long before it takes the next; walks at once.
ROW_MS_MAX = 150
WALKS_AT_ONCE_MAX = 2
ADMIN = ""  # the caller without a token: a cluster admin on a plaintext master
# What a refusal may be, beside the one expected: the call cut by the network's faults
# or a master down.
NOT_THROUGH = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class ReadSide:
    """The read side of one world's operator (see the module doc)."""

    def __init__(self, world: World, token_tenant: str) -> None:
        self.world = world
        self.rng = random.Random(f"{world.config.seed}/read-side-calls")
        self.checker = CatalogChecker()
        for name in world.stream_names:
            self.checker.asked_to_create(name)
        self.live: list[str] = []  # its streams not deleted
        self.deleted: list[str] = []  # its streams deleted, maybe undeleted since
        self.created = 0
        self.walking = 0
        # A token of each tenant the read side may call as: the tenant's, by tenant.
        self.tokens: dict[str, list[str]] = {}
        if world.config.tokens:
            for process in world.processes:
                if process.name != self._revoked_process():
                    self.tokens.setdefault(token_tenant, []).append(world.tokens[process.name][0])

    def _revoked_process(self) -> str:
        config = self.world.config
        return self.world.processes[config.revoked_token % len(self.world.processes)].name

    async def run(self) -> None:
        world = self.world
        actions: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (0.15, self._create),
            (0.07, self._delete),
            (0.05, self._undelete),
            (0.24, self._walk),
            (0.03, self._seal),
            (0.1, self._describe),
            (0.11, self._status),
            (0.11, self._console),
            (0.08, self._tokens_and_keys),
            (0.03, self._bad_listing),
            (0.03, self._plans),
        ]
        while world.phase == "safety":
            await asyncio.sleep(self.rng.randint(1, READ_EVERY_MS) / 1000)
            if world.phase != "safety" or world.violation is not None:
                break
            self._look()
            roll = self.rng.random()
            action = actions[-1][1]
            for share, candidate in actions:
                if roll < share:
                    action = candidate
                    break
                roll -= share
            if action == self._walk:
                # A dashboard pages on while the operator goes on: walks overlap the
                # creates and deletes.
                if self.walking < WALKS_AT_ONCE_MAX:
                    world.group.create_task(self._act(action))
            else:
                await self._act(action)
        world.count("read side streams seen removed", len(self.checker.gone))

    async def _act(self, action: Callable[[], Awaitable[None]]) -> None:
        world = self.world
        name = action.__name__.strip("_")
        try:
            async with asyncio.timeout(ACTION_S_MAX):
                await action()
        except TimeoutError:
            world.count(f"read side {name} cut short")
        except StreamEngineError as error:
            world.note(f"read side: {name}: {type(error).__name__}")
            world.count(f"read side {name} {type(error).__name__}")
        except grpc.aio.AioRpcError as error:
            world.note(f"read side: {name}: {error.code().name}")
            world.count(f"read side {name} {error.code().name}")

    # ---- looking at the truth ----

    def _look(self) -> int | None:
        """The serving master's streams now (None while no master serves)."""
        state = self.world.masters.state
        if state is None:
            return None
        looks = []
        self.world.check(lambda: looks.append(self.checker.look(wall_ms(), state)))
        return looks[0].index if looks else None

    def _before(self) -> int | None:
        looked = self._look()
        return looked if looked is not None else self.checker.last_look()

    def _shown(self, shown: Shown, before: int | None, after: int | None = None) -> None:
        """`shown`, answered after look `before` and before look `after` (by default a
        look taken now, or the next one once a master serves)."""
        if after is None:
            after = self._look()
        if self.world.check(self.checker.shown, shown, before, after):
            self.world.count("read side answers checked")

    # ---- callers ----

    def _caller(self) -> tuple[str, str]:
        """A caller: (its tenant, its token), ("", "") for the cluster admin."""
        tenants = sorted(self.tokens)
        if not tenants or self.rng.random() < 0.5:
            return ADMIN, ""
        tenant = self.rng.choice(tenants)
        return tenant, self.rng.choice(self.tokens[tenant])

    def _client(self, token: str) -> StreamClient:
        address = self.world.masters.address
        if not token:
            return self.world.client()
        return StreamClient.from_transport(address, self.world.tenant_transport(token))

    @staticmethod
    def _as(tenant: str) -> str:
        return f"as {tenant}" if tenant else "as admin"

    # ---- its own streams: created, deleted, undeleted ----

    async def _create(self) -> None:
        """`stream create` of one new stream (`StreamClient.create_stream`), of a few at
        once (`create_streams`: one master commit), or of one of its own again
        (answered as it stands); or `tenant create` of one of its tenants (which may
        exist)."""
        roll = self.rng.random()
        if roll < 0.1:
            tenant = self.rng.choice(TENANTS)
            async with self._client("") as client:
                reply = await client.master.CreateTenant(
                    master_pb2.CreateTenantRequest(tenant=tenant), timeout=CALL_S
                )
            self.world.count(f"read side tenants {'created' if reply.created else 'existing'}")
            return
        if roll < 0.3 and self.live:
            names = [self.rng.choice(self.live)]
        else:
            count = min(1 if roll < 0.8 else self.rng.randint(2, 3), CREATED_MAX - self.created)
            if count <= 0:
                return
            names = []
            for _ in range(count):
                self.created += 1
                names.append(f"{self.rng.choice(TENANTS)}/x{self.created}")
                self.checker.asked_to_create(names[-1])
        policy = self.world.config.policy
        before = self._before()
        async with self._client("") as client:
            if len(names) == 1:
                infos = [
                    await client.create_stream(
                        names[0], replicas=policy.replicas, write_quorum=policy.write_quorum
                    )
                ]
            else:
                infos = await client.create_streams(
                    names, replicas=policy.replicas, write_quorum=policy.write_quorum
                )
        for info in infos:
            if info.name not in self.live:
                self.live.append(info.name)
        ids = {info.name: info.stream_id for info in infos}
        self.world.note(f"read side: created {ids}")
        self.world.count("read side streams created", len(infos))
        shown = Shown(f"create {names}", list(ids), ids, in_order=False, complete=False)
        self._shown(shown, before)

    async def _delete(self) -> None:
        if not self.live:
            return
        name = self.rng.choice(self.live)
        self.live.remove(name)
        self.deleted.append(name)
        async with self._client("") as client:
            await client.master.DeleteStream(
                master_pb2.DeleteStreamRequest(name=name), timeout=CALL_S
            )
        self.world.note(f"read side: deleted {name}")
        self.world.count("read side streams deleted")

    async def _undelete(self) -> None:
        if not self.deleted:
            return
        name = self.rng.choice(self.deleted)
        async with self._client("") as client:
            try:
                await client.master.UndeleteStream(
                    master_pb2.UndeleteStreamRequest(name=name), timeout=CALL_S
                )
            except grpc.aio.AioRpcError as error:
                if error.code() not in (
                    grpc.StatusCode.NOT_FOUND,  # removed: its grace ran out
                    grpc.StatusCode.INVALID_ARGUMENT,  # not deleted: undeleted before
                ):
                    raise
                self.deleted.remove(name)
                self.world.count(f"read side undelete {error.code().name}")
                return
        self.deleted.remove(name)
        self.live.append(name)
        self.world.note(f"read side: undeleted {name}")
        self.world.count("read side streams undeleted")

    # ---- what it reads ----

    async def _walk(self) -> None:
        """`streamengine stream list` with filters, a few streams a page."""
        caller, token = self._caller()
        tenant_filter = ""
        if self.rng.random() < 0.5:
            tenant_filter = caller or self.rng.choice(TENANT_FILTERS)
            if self.rng.random() < 0.1:
                tenant_filter = self.rng.choice(TENANT_FILTERS)
        prefix = ""
        if self.rng.random() < 0.1:
            prefix = self.rng.choice(PREFIXES)
        elif self.rng.random() < 0.5:
            prefix = (tenant_filter or caller or "t1") + self.rng.choice(PREFIXES_WITHIN)
        page_size = self.rng.choice(PAGE_SIZES)
        names: list[str] = []
        ids: dict[str, int] = {}
        self.walking += 1
        try:
            before = self._before()
            async with self._client(token) as client:
                async for info in client.list_streams(tenant_filter, prefix, page_size):
                    names.append(info.name)
                    ids[info.name] = info.stream_id
                    # Its rows drawn one by one: the next page is asked for later.
                    await asyncio.sleep(self.rng.randint(0, ROW_MS_MAX) / 1000)
        finally:
            self.walking -= 1
        what = (
            f"walk (tenant {tenant_filter!r}, prefix {prefix!r}, pages of {page_size}) "
            f"{self._as(caller)}"
        )
        self.world.note(f"read side: {what}: {len(names)} streams")
        self.world.count("read side walks")
        self._shown(Shown(what, names, ids, tenant_filter, prefix, caller), before)

    async def _describe(self) -> None:
        """`streamengine stream describe NAME`."""
        name = self.rng.choice(sorted(self.checker.asked))
        caller, token = self._caller()
        what = f"describe {name} {self._as(caller)}"
        before = self._before()
        async with self._client(token) as client:
            try:
                info = await client.describe_stream(name)
            except NotFound:
                self.world.count("read side describe NotFound")
                # Not shown: then it was not held throughout.
                self._shown(Shown(what, [], {}, name=name, caller_tenant=caller), before)
                return
            except PermissionDenied:
                if not caller or name.startswith(f"{caller}/"):
                    self.world.check(
                        _raise, Violation(16, f"{what}: refused a caller its own stream")
                    )
                self.world.count("read side describe refused another tenant's stream")
                return
        self.world.count("read side describes")
        if info.name != name:
            self.world.check(_raise, Violation(16, f"{what}: answered {info.name}"))
        shown = Shown(
            what, [info.name], {info.name: info.stream_id}, caller_tenant=caller, name=name
        )
        self._shown(shown, before)

    async def _status(self) -> None:
        """`streamengine status --json`."""
        caller, token = self._caller()
        before = self._before()
        async with self._client(token) as client:
            status = await client.master.GetClusterStatus(
                master_pb2.GetClusterStatusRequest(), timeout=CALL_S
            )
        self.world.count("read side status")
        self._status_shown(f"status {self._as(caller)}", status_dict(status), caller, before)

    def _status_shown(
        self,
        what: str,
        status: Mapping[str, Any],
        caller: str,
        before: int | None,
        after: int | None = None,
    ) -> None:
        """A status (as `status --json` prints it, or the console's `/api/status`):
        only the caller's tenant's names in it, its counts agreeing with its rows, and
        its rows, when they hold every stream, what the master held."""
        if not self.world.check(_status_consistent, what, status, caller):
            return
        rows = [row["name"] for row in status["streams"]]
        ids = {row["name"]: row["stream_id"] for row in status["streams"]}
        every = sum(t["streams"] for t in status["tenant_streams"]) <= STATUS_STREAMS_MAX
        shown = Shown(what, sorted(rows), ids, caller_tenant=caller, complete=every)
        self._shown(shown, before, after)

    async def _console(self) -> None:
        """The console's `/api/status` and `/metrics`, as a browser asks them of one
        master's `--metrics-port`, as the admin or with a tenant's token."""
        masters = self.world.masters
        master: SimMaster | SimElectedMaster = (
            masters.embedded if masters.embedded is not None else self.rng.choice(masters.elected)
        )
        console, registry = master.console, master.registry
        serving = master.serving.is_set() if isinstance(master, SimMaster) else master.running
        if console is None or registry is None or not serving:
            return  # its port is closed
        caller, token = self._caller()
        path = self.rng.choice(("/api/status", "/api/status", "/metrics"))
        header = f"Bearer {token}" if token else None
        latest = console.latest()
        reply = console_reply(path, latest, registry, INSECURE, header, wall_ms())
        what = f"console {master.name}{path} {self._as(caller)}"
        self.world.count("read side console")
        if isinstance(latest, dict):
            body = json.loads(reply.body)
            if reply.code != 200 or not body.get("starting"):
                self.world.check(_raise, Violation(16, f"{what}: a standby answered {body}"))
            return
        if path == "/metrics":
            expected = 403 if caller else 200
            if reply.code != expected:
                self.world.check(_raise, Violation(16, f"{what}: {reply.code}, not {expected}"))
            elif not caller and b"streamengine_master_streams " not in reply.body:
                self.world.check(_raise, Violation(16, f"{what}: no stream gauge"))
            return
        if reply.code != 200:
            self.world.check(_raise, Violation(16, f"{what}: {reply.code} {reply.body!r}"))
            return
        status = json.loads(reply.body)
        published = console.published_ms
        segments = status["segments"]
        stray = [name for name, held in segments.items() if any(s["stream"] != name for s in held)]
        if stray or sorted(segments) != sorted(row["name"] for row in status["streams"]):
            self.world.check(
                _raise, Violation(16, f"{what}: segments of {sorted(segments)} beside its rows")
            )
            return
        # The view is the master's state when it was published.
        before = self.checker.last_look(before_ms=published)
        after = self.checker.first_look_after(published)
        self._status_shown(what, status, caller, before, after)

    async def _seal(self) -> None:
        """`streamengine seal NAME` of one of the world's streams (what a Spark job runs
        before it reads): its leader asked to roll, or, with none, the operator leading
        for a moment; the segment it answers is sealed at the master."""
        world = self.world
        streams = [s for s in world.stream_names if s not in world.removed | set(world.held_off)]
        name = self.rng.choice(streams)
        async with self._client("") as client:
            epoch = await client.seal(name, timeout_s=SEAL_S)
            sealed = [s.sealed for s in await client.list_segments(name) if s.epoch == epoch]
        world.note(f"read side: sealed {name} through {epoch}")
        world.count("read side seals")
        if sealed == [False]:
            # Sealed, or trimmed since (not listed): never listed open.
            world.check(_raise, Violation(16, f"seal {name} answered {epoch}, listed {sealed}"))

    async def _bad_listing(self) -> None:
        """`stream list` with what the master must refuse (invariant 6): a page token
        it never handed out, one handed out for other filters, a page too large, a
        malformed tenant, a prefix longer than any name. Each INVALID_ARGUMENT."""
        async with self._client("") as client:
            first = await client.master.ListStreams(
                master_pb2.ListStreamsRequest(page_size=1), timeout=CALL_S
            )
            bad = self.rng.choice(
                [
                    master_pb2.ListStreamsRequest(page_token="not a token", page_size=1),
                    master_pb2.ListStreamsRequest(
                        tenant="t1", page_token=first.next_page_token or "eA==", page_size=1
                    ),
                    master_pb2.ListStreamsRequest(page_size=listing.PAGE_STREAMS_MAX + 1),
                    master_pb2.ListStreamsRequest(tenant="no such/tenant"),
                    master_pb2.ListStreamsRequest(
                        name_prefix="x" * (listing.NAME_PREFIX_CHARS_MAX + 1)
                    ),
                ]
            )
            try:
                await client.master.ListStreams(bad, timeout=CALL_S)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self.world.count("read side bad listings refused")
                    return
                if error.code() in NOT_THROUGH:
                    raise
                got = error.code().name
            else:
                got = "OK"
        self.world.check(_raise, Violation(6, f"stream list with {bad}: {got}"))

    async def _plans(self) -> None:
        """`drain STORE --dry-run` and `rebalance --dry-run`: what the master would do,
        changing nothing."""
        async with self._client("") as client:
            if self.rng.random() < 0.5:
                store = self.rng.choice(sorted(self.world.stores))
                request: Any = master_pb2.DrainStoreRequest(store_id=store, dry_run=True)
                plan = await client.master.DrainStore(request, timeout=CALL_S)
            else:
                request = master_pb2.RebalanceRequest(dry_run=True)
                plan = await client.master.Rebalance(request, timeout=CALL_S)
        stores = set(self.world.stores)
        strays = [t for t in plan.tasks if not {t.source_store, t.target_store} <= stores]
        if strays:
            self.world.check(_raise, Violation(16, f"{request}: tasks {strays}"))
        self.world.count(f"read side {type(request).__name__.removesuffix('Request')} plans")

    async def _tokens_and_keys(self) -> None:
        """`streamengine token create --tenant T --role read`, `key list` (or `key
        rotate`), and the tenants, as the admin or a tenant's token sees them."""
        roll = self.rng.random()
        if roll < 0.4:
            tenant = self.rng.choice(("t0", "t1", "t2", *TENANTS))
            async with self._client("") as client:
                reply = await client.master.CreateToken(
                    master_pb2.CreateTokenRequest(tenant=tenant, role=master_pb2.TOKEN_ROLE_READ),
                    timeout=CALL_S,
                )
            self.tokens.setdefault(tenant, []).append(reply.token)
            self.world.note(f"read side: token {reply.token_id} of {tenant}")
            self.world.count("read side tokens created")
        elif roll < 0.6:
            # `key rotate` now and then: a new key signs once every store can have
            # heard of it, and what the old one signed holds until it expires.
            rotate = self.rng.random() < 0.3
            async with self._client("") as client:
                if rotate:
                    keys = await client.master.RotateSigningKey(
                        master_pb2.RotateSigningKeyRequest(), timeout=CALL_S
                    )
                else:
                    keys = await client.master.ListSigningKeys(
                        master_pb2.ListSigningKeysRequest(), timeout=CALL_S
                    )
            if not any(key.signing for key in keys.keys):
                self.world.check(_raise, Violation(16, f"key list: none signs: {keys}"))
            self.world.count("read side keys rotated" if rotate else "read side key lists")
        else:
            caller, token = self._caller()
            async with self._client(token) as client:
                listed = await client.master.ListTenants(
                    master_pb2.ListTenantsRequest(), timeout=CALL_S
                )
            others = [t for t in listed.tenants if caller and t != caller]
            if others:
                self.world.check(
                    _raise, Violation(16, f"tenants {self._as(caller)}: shown {others}")
                )
            self.world.count("read side tenant lists")


def _raise(violation: Violation) -> None:
    raise violation


def _status_consistent(what: str, status: Mapping[str, Any], caller: str) -> None:
    """A status shows a tenant's caller only its own names, and its counts per tenant
    agree with its rows: each stream counted once, under its worst health, every
    deleted one flagged; when the rows hold every stream, one row per stream counted."""
    named = _names_in(status)
    if caller and any(not name.startswith(f"{caller}/") for name in named):
        strays = sorted(name for name in named if not name.startswith(f"{caller}/"))
        raise Violation(16, f"{what}: {caller}'s caller shown {strays}")
    tenants = {t["tenant"]: t for t in status["tenant_streams"]}
    if caller and set(tenants) - {caller}:
        raise Violation(16, f"{what}: {caller}'s caller shown tenants {sorted(tenants)}")
    rows = status["streams"]
    names = [row["name"] for row in rows]
    if len(set(names)) != len(names):
        raise Violation(16, f"{what}: a stream in two rows: {names}")
    every = sum(t["streams"] for t in tenants.values()) <= STATUS_STREAMS_MAX
    for tenant, counts in sorted(tenants.items()):
        mine = [row for row in rows if row["name"].startswith(f"{tenant}/")]
        deleted = sum(1 for row in mine if row["deleted_until_ms"])
        flagged = counts["under_replicated"] + counts["sealing"] + counts["deleted"]
        if flagged > counts["streams"] or not counts["deleted"] <= deleted <= flagged:
            raise Violation(16, f"{what}: {tenant}'s counts {counts} beside {deleted} deleted")
        if every and len(mine) != counts["streams"]:
            raise Violation(16, f"{what}: {tenant} counts {counts['streams']}, rows {len(mine)}")


def _names_in(status: Mapping[str, Any]) -> list[str]:
    """Every stream name a status (`status_view.status_dict`) shows."""
    names = [row["name"] for row in status["streams"]]
    for key in ("under_replicated", "verifying", "tasks", "pending_deletes"):
        names += [item["stream"] for item in status[key]]
    names += [item["stream"] for item in status["durability"]["worst"]]
    for name, segments in status.get("segments", {}).items():
        names += [name, *(segment["stream"] for segment in segments)]
    return names


def pages_by_offset(
    sorted_names: Sequence[str], tenant: str, name_prefix: str, page_token: str, size: int
) -> listing.Page:
    """`listing.list_page` with a page token that counts the names before the next page
    instead of naming the last one (the `pages_by_offset` flaw; tokens still bound to
    their filters and refused when they do not decode): a stream created or removed
    before it while a caller walks shifts every later page, which then repeats a name
    or skips one."""
    prefix = listing.name_range(tenant, name_prefix)
    size = listing.page_size(size)
    if prefix is None:
        return listing.list_page(sorted_names, tenant, name_prefix, page_token, size)
    start = 0
    if page_token:
        start = int(listing.decode_page_token(page_token, prefix).removeprefix(prefix))
    selected = [name for name in sorted_names if name.startswith(prefix)]
    names = tuple(selected[start : start + size])
    more = start + size < len(selected)
    token = listing.encode_page_token(prefix, f"{prefix}{start + size}") if more else ""
    return listing.Page(names, token)
