"""The world on the runtime: the shipped system under a seeded workload and nemesis.

Theory of operation. A seed draws a `WorldConfig` (policy, stores, client processes,
streams, faults, lease, workload, nemesis) and then everything runs on one `SimLoop`:
the shipped master (`SimMaster` on in-memory metadata, or 1-3 `SimElectedMaster`s on a
`SimEtcd`, as `WorldConfig.masters` says) and stores (`SimStore`), client processes
that each open a `StreamClient` on their own node of the `SimNetwork` and lead their
streams through the shipped writer (rivals race for some of them), and followers
reading every stream back through the shipped subscription. Nothing here stands in for
a shell.

The safety phase runs `safety_ms` of virtual time under network faults and a nemesis
on the loop's timers: stores crashing with their machine's power (fsync on or off) and
coming back, now and then with a wiped disk (a new incarnation); partitions and
connection resets; client processes crashing (cut off, their tasks cancelled; a new
incarnation takes over through the shipped recovery); the master restarting over the
same metadata, or, on etcd, the active master killed, stopped cleanly, or cut off from
etcd and the stores, and etcd itself going down and back. In a share of seeds (each
drawn from the seed's later generator): the client processes lead one tenant's streams
under write tokens of their own and the operator revokes one; a wiped store's
registration answers are lost, so that it registers again; and stored events rot at
rest while the stores' scrub runs: a byte flipped, or, where the master holds the
segment's certificate, a copy forged under a valid crc32c, which only the certificate
tells. In a share of seeds (drawn from a generator of their own,
`WorldConfig.with_losses`) data is lost for good once: replicas of one
segment are destroyed on all but one of its stores, and where that leaves an unsealed
segment short of R the operator stops the processes leading its stream and runs what
`streamengine seal --accept-loss` runs (`StreamClient.seal`), now and then interrupted
once the survivor holds a bridge the master has not recorded, until it is done; or the
master's metadata is lost and it starts again with `--rebuild`, and the operator
creates a stream once it serves what it rebuilt. In a few seeds (`CROWD_SHARE`, none in
the CI band) one or two client processes each lead a crowd of 100-300 streams, a few
batches each, with a shorter safety phase. In a share of seeds (`MANY_SHARE`, from a
generator of their own, `WorldConfig.with_many`) followers of many streams read through
one `StreamClient.subscribe_many` each, by names or by a tenant's prefix (in a crowd seed,
every stream), as a resuming application does: per stream the sequence after the last
event handled, the subscription dropped now and then and opened again from those
positions; each event goes to its stream's checker. In a share of seeds
(`PRESSURE_SHARE`, from a generator of their own, `WorldConfig.with_pressure`) the
stores are under pressure: a write queue of a few hundred bytes, a per-tenant append
quota the master tells them, or both; writes refused for now (busy, over quota) write
nothing and are sent again after a pause, and a store may hold a writer's later batch
past the one it refused (the run's stats count the refusals). The liveness phase then
heals the network, brings every node back, stops faults, and must converge within
`LIVENESS_MS`: every stream's leader gets a marker acked, and every follower has read
every event ever acked (but of a stream the operator undeleted after its grace ran out,
which the master removed: a loss it asked for; nor those a follower was told
`DataLossError` for: a loss an operator accepted).

The checkers are `tests.sim.checkers.Checker`s, one per stream, fed with what the
shipped shells returned: acks (invariant 1 and 2, the gate on earlier segments),
events followers read, how and when each append ended (invariant 7: an append ends
within the writer's append timeout, acked or with a typed SDK error), and periodic
audits of every store's served prefix and sealed replicas against the master
(invariants 2, 4, 5); no store takes a write or a seal below its fence, as its core
plans it (invariant 3); nothing sent under a token every store knows is revoked is taken
(invariant 11); a wiped store joins as one incarnation knowing every replica it lost
(invariant 14); every rotted replica is found and its segment back to N sound replicas
(invariant 10); a sealed segment's certificate never changes and its replicas at the
bridge hold it, and the master condemns, and readers report, only replicas that differ
from it (invariant 12); a follower is told `DataLossError` only where the master
declared a loss, and an acked event it never read is excused only by one it was told
(invariant 1); a stream rebuilt from the stores keeps its id, and one created after a rebuild
takes a new one (invariant 5); and a `MasterChecker` for the cluster (invariant 5: never two masters
serving, every etcd commit the active master's, epochs never going back, across a
rebuild too). In half the operator seeds its read side (`read_side.ReadSide`) lists,
describes and reads the status and the console all along, as the admin and as tenants,
each answer held to the master's streams before and after it (`CatalogChecker`,
invariant 16). In a share of the others (`ANALYTICS_SHARE`, from a generator of their
own, `WorldConfig.with_analytics`) Spark jobs (`analytics.Analyst`) scan the streams,
run streaming queries over them and write a stream of their own through the shipped
data source, each row held to its stream's checker as a bounded reader's, and once the
world converged every stream scanned whole and the sink's rows found once each.

    python -m tests.sim N                  # one seed, with its trace
    python -m tests.sim --soak K --first F

Flaws (`RUNTIME_FLAWS`) switch a defect back into the shipped code for one run, so
that a test can show the world still finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import shutil
import tempfile
import time
import traceback
import types
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from unittest import mock

import grpc
import pyarrow as pa

from streamengine import StreamClient, StreamEvent
from streamengine.client import spark
from streamengine.client import writer as writer_shell
from streamengine.client.core import recovery as sr
from streamengine.client.core import store_session as store_sessions
from streamengine.client.core import writer as writer_core
from streamengine.client.core.recovery import SegmentRecovery
from streamengine.client.core.recovery_plan import RecoveryPlan, plan_recovery
from streamengine.client.core.replicas import ReplicaSet
from streamengine.client.core.replicator import Replicator
from streamengine.client.core.subscription import (
    Cursor,
    DataLoss,
    Finished,
    Next,
    SegmentView,
    Unreachable,
)
from streamengine.client.errors import (
    AppendFailed,
    AppendTimedOut,
    DataLossError,
    LeadershipLost,
    PermissionDenied,
    StreamEngineError,
    Trimmed,
)
from streamengine.client.packed import Packed
from streamengine.client.recovery import SegmentSealer
from streamengine.client.stream_client import SEAL_TIMEOUT_S
from streamengine.client.subscription import Follower
from streamengine.client.wire import LeaseSecret
from streamengine.client.writer import Writer
from streamengine.master import replies, service_tokens
from streamengine.master.core import authority as authority_core
from streamengine.master.core import integrity as integrity_core
from streamengine.master.core import listing
from streamengine.master.core import rebuild as rebuild_core
from streamengine.master.core.integrity import Judgement
from streamengine.master.core.leader_acked import LeaderAckedOwed
from streamengine.master.core.model import StreamRecord
from streamengine.master.core.retention import DELETE_GRACE_MS_DEFAULT
from streamengine.master.etcd import parse_etcd_url
from streamengine.master.integrity import Integrity
from streamengine.master.leadership import Leadership, SessionRenewal
from streamengine.master.replicas import Replicas
from streamengine.master.service_segments import SegmentHandlers
from streamengine.master.state import MasterState
from streamengine.master.stores import StoreRegistry
from streamengine.protocol import codec, framed, framed_peer
from streamengine.protocol.auth import Principal
from streamengine.protocol.backoff import STORE_STREAM_REOPEN
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.entry import (
    VALUE_HEADER_BYTES,
    CorruptEntry,
    EntryKind,
    StoredEntry,
    decode_value,
    encode_value,
)
from streamengine.protocol.grants import Grant, GrantSegment
from streamengine.protocol.limits import TENANT_APPEND_BYTES_PER_S_DEFAULT
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.sequence import unpack_sequence
from streamengine.protocol.signing import (
    KEY_ID_BYTES,
    MAGIC_BYTES,
    SIGNATURE_BYTES,
    MalformedPayload,
)
from streamengine.protocol.transport import Transport
from streamengine.segment_store import master_link
from streamengine.segment_store import metrics as store_metrics
from streamengine.segment_store import reads as store_reads
from streamengine.segment_store import tail as store_tails
from streamengine.segment_store.copy import SegmentCopy
from streamengine.segment_store.core import writes as writes_core
from streamengine.segment_store.core.authority import (
    GrantRefused,
    StoreAuthority,
    WriteStreamGrants,
)
from streamengine.segment_store.core.commands import (
    Command,
    DeleteCommand,
    JoinCommand,
    Outcome,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.keys import CLUSTER_ID_KEY, SegmentMeta, entry_index, entry_key
from streamengine.segment_store.core.kv import Put
from streamengine.segment_store.core.scrub import ScanResult
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.group_commit import STORE_QUEUE_BYTES_MAX
from streamengine.segment_store.scrub import Scrubber
from streamengine.segment_store.store_context import segment_key
from streamengine.testing import wait_until
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from tests.faults import badinput
from tests.sim.checkers import Checker, MasterChecker, Violation, sound_copies
from tests.sim.faults import Faults
from tests.sim.runtime import secured
from tests.sim.runtime.analytics import Analyst
from tests.sim.runtime.etcd import SimEtcd
from tests.sim.runtime.front_door import FRONT_DOOR_SHARE, FrontDoor
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimElectedMaster, SimMaster
from tests.sim.runtime.read_side import ReadSide, pages_by_offset
from tests.sim.runtime.security import ClusterCerts, cluster_certs
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import (
    CURRENT_NODE,
    SEND_BUFFER_BYTES_DEFAULT,
    SimNetwork,
    StreamFaults,
    node_context,
)

# Defects the world must find, each switched back into the shipped code for one run:
# `park_forever`: a writer leading an epoch granted without a segment parks appends and
# never times them out (issue #35, defect 3);
# `fail_in_doubt`: a writer stepping down tells users an append failed that may be
# durable; `forget_pending`: it loses its pending appends as it steps down (they hang);
# `ack_before_seal`: a new segment acks before the earlier ones are sealed;
# `revoked_stream_writes`: a store's Write stream opened under a token takes writes
# after the store heard the token was revoked (it proved its caller only at its open);
# `lost_answered_once`: a wiped store's lost replicas are answered only by the
# registration that first sees its new incarnation (issue #35, defect 1);
# `scrub_blind`: the scrub reads a damaged replica back and tells nobody;
# `scrub_crc_only`: the master takes a replica its scrub read back with every crc32c
# holding for one that holds the certificate, so a copy forged under a valid crc32c is
# never condemned, nor replaced (`World._sound_replicas` holds it to the certificate);
# `writer_overturned_by_w`: W replicas agreeing on another certificate overturn a
# writer's nobody confirmed, even at W=1, where one copy forged at rest and scrubbed
# first becomes the segment's certificate (seed 1003);
# `condemn_verified_at_once`: a replica that matched the certificate and then differs
# is condemned at once, not read again first, so a scrub report older than a refill in
# place condemns the good copy that replaced what it read (seed 1003 beside
# `bridge_unheard`);
# `trust_any_bridge`: a recovery accepting loss takes any bridge its plan found as proof
# that nothing was lost (`lost_from_index=0`), and raises the survivors' acked index to
# it (issue #35, defect 2);
# `pages_by_offset`: a ListStreams page token counts the names before the next page, so
# streams created or removed during a walk shift its pages (`read_side.pages_by_offset`);
# `secret_in_grant_only`: a writer shows no lease secret until a grant's answer hands it
# one the master drew, so a grant whose answer is lost is granted again, anew;
# `attention_named_once`: a session's renewal names a stream owed a roll once, and a
# renewal's answer lost leaves its leader deaf to the roll (`World._rolls_heard`);
# `standby_state_first`: `SealSegment` reads the active master's state before its call
# can refuse a standby, which answers UNKNOWN (`World._call_standbys`);
# `dial_once`: a dial sends one SYN (then the kernel's retransmissions) until its
# timeout, and a store's Write stream pauses after it (`World._healed_cuts_crossed`);
# `rebuild_from_whoever_answered`: `master --rebuild` decides once the stores registered
# so far answered, whatever they know of the cluster, and gives stream ids from those
# they hold (the stores' cluster views unread, cards too: seeds 2008 and 2092);
# `rebuild_without_cards`: it reads no stream card of the views, so a stream whose
# records reached no store is lost or kept nameless (seed 2499);
# `bridge_short_everywhere`: a Spark range planned from an open segment takes a bridge
# in it for a replica holding less (`analytics.Analyst`: a loss nobody declared);
# `chunk_answered_by_acked`: a certified Spark read takes a replica's acked entries for
# what it serves, verified or not (the last scans never end);
# `release_acked_untold`: the master keeps the acked index a closing writer gives back
# to itself, so events acked on stores that never heard it stay unread until a writer
# leads the stream again (`analytics.Analyst`'s sink: seed 227);
# `open_range_read_as_sealed`: a Spark range of an open segment takes every replica
# serving less than it for a loss, though their acked indexes may still grow;
# `close_waits_for_the_peer`: a data connection is closed gracefully whatever it still
# buffers, so its holder waits for a peer that takes nothing (`World._closes_ended`);
# `rebuild_without_granted_names`: the rebuild reads no stream name the stores kept from
# their grants, so a stream none of whose records or cards reached a store comes back
# nameless (seed 4600);
# `resend_without_dedup`: a producer's batch goes as a plain append, without its mark
# and unseen by the table, so a resend through the next writer of an event already in
# the stream writes it again;
# `serve_matched`: a store serves its tails and acked-only reads up to its matched
# index, not the acked index it was told;
# `ignore_fence`: a store takes a write below its segment's fence, as though at the
# fence (`World._store_planned`: invariant 3);
# `copy_unfenced`: CopySegment as it was, the copy's fence a delete of the copy and its
# fence, every batch acked up to the final index before the digest;
# `ignore_grant`: a store's grant check lets a Seal, or a Write stream's grant shown,
# through whatever the grant is (none, forged, another's); `ungranted_writes` is a
# Write stream that shows none;
# `skip_by_matched`: a recovery trusts a store's matched index and answers for the
# rewrites of indexes it holds already, so a stale copy, or what it holds where the
# bridge goes, stays and is acked (seed 36);
# `ack_before_loss`: a recovery accepting loss raises the holders' acked index to the
# bridge before the master records the loss (issue #35, defect 2; seed 749);
# `loss_ends_at_final`: a reader past the bridge of a segment sealed accepting loss (read
# there from a replica since destroyed) hops on, as though the loss ended at the bridge
# (issue #35, defect 2; seed 51);
# `short_read`: a bounded read that no replica can serve ends as though its range were
# read, instead of raising Unavailable (issue #36; `analytics.Analyst`'s reads, seed
# 1826);
# `keep_past_gap`: a producer stream's recovery keeps copies past an index no store
# holds, as a plain stream's does: a producer's batch a store took past the one it
# refused for now (stores under pressure) survives its lost predecessor, whose events
# the next leader's table answers as written (`_keeping_past_gaps`).
# `bridge_unheard`: a follower takes no notice of a replica's bridge in a segment its
# list shows open, so it reads a sealed segment's copies at rest under crc32c alone,
# though the master lists the certificate that would tell a forged one (seed 1307).
RUNTIME_FLAWS = (
    "park_forever",
    "fail_in_doubt",
    "forget_pending",
    "ack_before_seal",
    "revoked_stream_writes",
    "lost_answered_once",
    "scrub_blind",
    "scrub_crc_only",
    "writer_overturned_by_w",
    "condemn_verified_at_once",
    "trust_any_bridge",
    "ungranted_writes",
    "pages_by_offset",
    "secret_in_grant_only",
    "attention_named_once",
    "standby_state_first",
    "dial_once",
    "rebuild_from_whoever_answered",
    "rebuild_without_cards",
    "bridge_short_everywhere",
    "chunk_answered_by_acked",
    "release_acked_untold",
    "open_range_read_as_sealed",
    "close_waits_for_the_peer",
    "rebuild_without_granted_names",
    "resend_without_dedup",
    "serve_matched",
    "ignore_fence",
    "copy_unfenced",
    "ignore_grant",
    "skip_by_matched",
    "ack_before_loss",
    "loss_ends_at_final",
    "short_read",
    "keep_past_gap",
    "bridge_unheard",
)

# The safety phase lasts this much virtual time: a run's cost is about its appends
# (`appends_per_s`) and the heartbeats of its writers.
SAFETY_MS = 10_000
# The liveness phase must converge within this much virtual time.
LIVENESS_MS = 60_000
# The master link measures a real directory's free bytes; every simulated disk has this
# much, so placement replays whatever the machine's disk holds.
SIM_DISK_FREE_BYTES = 1 << 40
SIM_DATA_DIR = Path("/sim/data")
# How often the checkers audit every store and look for appends open too long.
AUDIT_EVERY_MS = 500
WATCH_EVERY_MS = 50
# An append ends within the writer's append timeout; the writer's clock task wakes at the
# deadline exactly, this leaves a few ticks for the answer to reach its caller.
APPEND_END_SLACK_MS = 20
# A bound leader owed a roll has asked its master once its session's renewals were
# answered this many leases after the roll was owed (`World._rolls_heard`): a renewal
# goes each third of a lease, a heartbeat's answer lost is known a lease later.
ROLL_HEARD_LEASES = 3
# A dial waiting on a cut sends a fresh SYN this soon after the cut heals
# (`World._healed_cuts_crossed`): the dial's next hedge, and a tick.
HEALED_CUT_CROSSED_S = (framed.DIAL_HEDGE_MS + 10) / 1000
# A connection's holder is done closing it within this long (`World._closes_ended`).
CLOSE_WAIT_S_MAX = 0.1
# A writer that lost leadership (or never got it) asks again after this long.
LEAD_AGAIN_MS = 100
# A follower whose subscription failed subscribes again after this long.
FOLLOW_AGAIN_MS = 200
# How long nodes may take to end once cancelled (a writer gives its lease back).
STOP_MS_MAX = 10_000
# How long setting the cluster up may take (stores join, streams are created).
SETUP_MS_MAX = 30_000
# With `WorldConfig.wipes`, the chance that a store's crash wipes its disk.
WIPE_CHANCE = 0.5
# The share of seeds with an operator, its delete graces, how often it acts, how long a
# stream stays deleted before it undeletes it, and how long its calls may take.
OPERATOR_SHARE = 0.4
OPERATOR_GRACES_MS = (3_000, 6_000)
OPERATOR_EVERY_MS = 1_500
DELETED_MS_MAX = 600
DRAINING_MS_MAX = 3_000
OPERATOR_CALL_S = 2.0
# The share of operator seeds whose operator reads all along too (`read_side.ReadSide`:
# paged listings, descriptions, the status and the console, as admin and as tenants),
# drawn apart.
READ_SIDE_SHARE = 0.5
# The share of seeds where each client process leads the streams of one tenant under a
# write token of its own, and the operator revokes one of them within the safety phase
# (between these two times).
TOKENS_SHARE = 0.3
TOKEN_TENANT = "t0"
REVOKE_AT_MS = (1_000, SAFETY_MS - 3_000)
# How `_call_ended` names a Write on a store's data plane (no gRPC method since #39).
STORE_WRITE = "/streamengine.v1.SegmentStore/Write"
# The share of seeds where a wiped store's registration answers are lost (1 or 2 of
# them, as the master answers them): it registers again.
REGISTRATION_ANSWERS_LOST_SHARE = 0.3
REGISTER_STORE = "/streamengine.v1.Master/RegisterStore"
# The share of seeds where the stores run their scrub and bytes of stored entries rot
# at rest (about every `ROT_EVERY_MS`, on a sealed replica whose segment keeps W sound
# replicas besides); each replica is read back again `SCRUB_RECHECK_MS` after its last
# read. Rotted replicas must be sound again within `REPAIRED_MS_MAX` of the liveness
# phase's convergence.
ROT_SHARE = 0.3
ROT_EVERY_MS = 1_500
SCRUB_RECHECK_MS = 1_000
REPAIRED_MS_MAX = 10_000
# The share of rot events that forge the copy under a valid crc32c (its payload changed,
# its crc computed again) instead of flipping a bit, where the master holds the
# segment's certificate: the crc32c cannot tell such a copy, only the certificate can
# (invariant 12). Drawn from a generator of its own (`World.forge_draws`), so that the
# world's draws stay where they were until the first copy forged.
FORGE_SHARE = 0.5
# The share of seeds where one or two client processes each lead a crowd of streams
# (issue #35: a process leading hundreds of streams), how many each, how often each of
# their writers appends (a few batches per stream in the safety phase, whatever the
# number of streams), and their safety phase, shorter: a run's cost grows with its
# streams. Never in the CI band (seeds below `CROWD_FIRST_SEED`): a crowd seed takes
# tens of seconds.
CROWD_SHARE = 0.05
CROWD_STREAMS = (100, 300)
CROWD_APPEND_EVERY_MS = 2_000
CROWD_SAFETY_MS = 5_000
CROWD_FIRST_SEED = 10
# The share of seeds (under a policy with R > 1, none with wiped disks or fsync never)
# where the nemesis destroys replicas of one segment for good, once, at a time drawn in
# `LOSS_AT_MS`: each deleted and marked lost on its store, as a wiped store's new
# incarnation marks what it held. Of an unsealed segment, all but one (fewer than R
# left: no read quorum, nor a write quorum where W > 1): the stream is stuck, and the
# operator stops the processes leading it and runs what `streamengine seal
# --accept-loss` runs until it is done. Of a sealed one (`DESTROY_SEALED_CHANCE`), all
# but one replica holding the bridge, which repair copies back to N.
ACCEPT_LOSS_SHARE = 0.2
LOSS_AT_MS = (1_000, SAFETY_MS - 4_000)
# The share of seeds (on in-memory metadata, without tokens or an operator: the stores
# keep neither tokens nor retention, trims and deletes) where the master loses its
# metadata at a time drawn in `LOSS_AT_MS`, and starts again with `--rebuild`.
REBUILD_SHARE = 0.3
DESTROY_SEALED_CHANCE = 0.25
# The chance that the replicas destroyed are the most advanced ones (the survivor may
# then lack acked events: a loss to declare), not drawn at random.
DESTROY_AHEAD_CHANCE = 0.5
# The chance that an operator's seal is interrupted (as by Ctrl-C) once a survivor holds
# a bridge the master has not recorded: the next seal finds that bridge above the acked
# index (issue #35, defect 2). How often the world looks for it meanwhile.
SEAL_INTERRUPT_CHANCE = 0.5
SEAL_WATCH_MS = 1
# The share of seeds whose cluster is secured, as `streamengine cluster up` runs one
# (`WorldConfig.secured`, drawn apart): TLS on every call, the members (stores, masters)
# and each client process proving a certificate of the cluster's CA on every call (the
# processes and the operator as admins), tenants their tokens over TLS
# (`tests.sim.runtime.security`).
SECURED_SHARE = 0.3
# The share of seeds (from `INTRUDER_FIRST_SEED` on, drawn apart) where an intruder
# (node `intruder`) knocks at the shipped servers' front doors every few hundred ms,
# as the fault suite's S15 does on real processes (`tests.faults.badinput`): writes
# below a sealed replica's fence and bytes that parse as no request on the stores' data
# ports, streams the master must refuse to create. Each is refused with its status
# (invariant 6); what it would have changed, the audits and checkers see.
INTRUDER_SHARE = 0.2
INTRUDER_FIRST_SEED = 10
INTRUDER_EVERY_MS = (100, 600)
# The share of seeds (drawn apart) where an operator asks for rolls of random streams,
# one every so often (`World._ask_rolls`).
ROLL_ASKS_SHARE = 0.3
ROLL_ASK_EVERY_MS = (300, 2_000)
# The share of roll asks after which the leader's process loses its next few
# LeaseHeartbeat answers (its session's renewals and its writers' heartbeats).
ROLL_ASK_ANSWERS_LOST_SHARE = 0.5
ROLL_ASK_ANSWERS_LOST = 2
LEASE_HEARTBEAT = "/streamengine.v1.Master/LeaseHeartbeat"
# The share of seeds (drawn apart) whose stores and embedded master keep their data in
# RocksDB, as the shipped processes do, in a directory of the run on `ROCKSDB_ROOT`
# (tmpfs: a sync costs nothing there), instead of in memory. The stores with
# `fsync_never` stay in memory, where a power cut can take what they never synced.
ROCKSDB_SHARE = 0.3
# The share of seeds whose connections hold this little written and unread before a
# sender waits (a thin link, small socket buffers): a store that stops taking leaves
# its writers' buffers full, as a fast writer's are in S7 (`World._closes_ended`).
THIN_BUFFER_SHARE = 0.3
THIN_SEND_BUFFER_BYTES = 2 * 1024
ROCKSDB_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
# The share of seeds with two masters or more (drawn apart) where a client calls the
# standbys now and then, every call of the master's service, as a client given every
# master's address calls each until one answers (`World._call_standbys`).
STANDBY_CALLS_SHARE = 0.5
# Calls the standby caller leaves out: well formed and empty, they change the cluster
# (a new signing key, replicas moved) should their standby win the election meanwhile.
STANDBY_CALLS_LEFT_OUT = ("RotateSigningKey", "Rebalance")
STANDBY_CALL_S = 1.0
# What a refusal may be, beside the one expected: the intruder's own call cut by the
# network's faults or a server down.
NOT_THROUGH = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
# The share of seeds (from `MANY_FIRST_SEED` on, drawn apart: `WorldConfig.with_many`)
# with one or two followers of many streams through one `StreamClient.subscribe_many`,
# as a resuming application runs it: it keeps per stream the sequence after the last
# event it handled, drops the subscription within `MANY_DROP_MS` (one drawn) and
# resumes with those positions. In a crowd seed, the one follower of every stream.
MANY_SHARE = 0.3
MANY_FIRST_SEED = 10
MANY_DROP_MS = (1_000, 4_000)
# The share of seeds (drawn apart: `WorldConfig.with_analytics`) where Spark jobs read
# the streams and write a stream of their own through the shipped data source
# (`analytics.Analyst`); never beside the operator's trims and deletes nor replicas
# destroyed, which a scan is told of by design.
ANALYTICS_SHARE = 0.3
# The share of seeds (drawn apart: `WorldConfig.with_pressure`) whose stores are under
# pressure, as a loaded cluster's are: a write queue of a few hundred payload bytes (the
# group committer's `queue_bytes_max`, one drawn from `PRESSED_QUEUE_BYTES`, a quarter
# of it each authenticated caller's share), so that a writer's pipelined batches find
# it full now and then (REFUSED_BUSY); or a per-tenant append quota the master tells
# the stores (`tenant_append_bytes_per_s`, one drawn from `PRESSED_APPEND_BYTES_PER_S`),
# which bursts exceed now and then (REFUSED_QUOTA; a seed's tenants append 50-400 bytes
# per second to each store on average); or both (`PRESSURE_KINDS`). A batch refused for
# now writes nothing while a later one may be taken: the store holds entries past a
# gap, and the writer resends from its matched index after a pause. A crowd seed's
# tenants append far more: its stores get the small queue only.
PRESSURE_SHARE = 0.25
PRESSURE_KINDS = ("busy", "quota", "both")
PRESSED_QUEUE_BYTES = (64, 128, 256)
PRESSED_APPEND_BYTES_PER_S = (400, 700, 1_000)


@dataclass(frozen=True, slots=True)
class ManyFollower:
    """A follower of many streams: `names`, or (when `prefix` is not None) every stream
    whose name starts with `prefix`; it drops its subscription within `drop_ms` of
    starting it, in the safety phase, and resumes."""

    names: tuple[str, ...] = ()
    prefix: str | None = None
    drop_ms: int = MANY_DROP_MS[0]

    def covers(self, stream: str) -> bool:
        if self.prefix is not None:
            return stream.startswith(self.prefix)
        return stream in self.names

    def describe(self) -> str:
        if self.prefix is not None:
            return f"prefix {self.prefix!r}"
        return f"{len(self.names)} named"


def stream_names(streams: int) -> list[str]:
    """The streams of a world, spread over three tenants."""
    return [f"t{n % 3}/s{n}" for n in range(streams)]


@dataclass(frozen=True, slots=True)
class WorldConfig:
    seed: int
    policy: ReplicationPolicy
    stores: int
    processes: int  # client processes, each with its own StreamClient and node
    streams: int
    rivals: float  # the share of streams a second process races to lead
    followers: int
    faults: Faults
    lease_ms: int
    append_timeout_ms: int
    in_flight_max: int  # appends one writer has in flight at once
    batch_max: int
    appends_per_s: int  # over all streams together: the cost of a run
    chaos_every_ms: int
    store_down_ms_max: int
    safety_ms: int
    segment_bytes: int
    fsync_never: tuple[str, ...] = ()
    wipes: bool = False
    # Batches one producer keeps out at once, each at the sequences after the last
    # (a pipelined producer: its batches decide behind those held back in the writer).
    producer_batches_max: int = 1
    # 0: one master on in-memory metadata; 1-3: masters elected on an etcd.
    masters: int = 0
    # An operator making the CLI's stream calls: trims by hand, retention limits,
    # deletes undone within the grace (which is short, so trimmed segments leave).
    operator: bool = False
    delete_grace_ms: int = DELETE_GRACE_MS_DEFAULT
    # Writers with producer ids: each process resends what it was not told was written,
    # from the lowest, through each writer it makes (exactly once, issue #40).
    producers: bool = False
    # Write tokens of `TOKEN_TENANT`, one per client process, which leads that tenant's
    # streams under it (each of them with a rival); the operator revokes the token of
    # process `revoked_token` (modulo their number) at `revoke_at_ms`.
    tokens: bool = False
    revoke_at_ms: int = 0
    revoked_token: int = 0
    # How many registration answers a wiped store loses, each time it is wiped.
    registration_answers_lost: int = 0
    # Bit rot at rest in sealed replicas, with the stores' scrub running.
    rot: bool = False
    # Of the rot events, some forge a copy under a valid crc32c (`FORGE_SHARE`); off,
    # each flips a bit, as every one did before copies were forged (a seed's schedule
    # as it was then).
    forges: bool = True
    # The stores that sync and the embedded master keep their data in the shipped
    # RocksDB adapters (`RocksKV`, `RocksDBMetadata`) under a directory of the run.
    rocksdb: bool = False
    # What a connection holds written and unread before `drain` waits.
    send_buffer_bytes: int = SEND_BUFFER_BYTES_DEFAULT
    # Streams each client process leads in a crowd seed (0: not one): `processes` (1
    # or 2) lead `crowd` streams each, with no rival and no token.
    crowd: int = 0
    # At `loss_at_ms`: replicas of one segment destroyed for good, and the operator's
    # `seal --accept-loss` where that left the stream stuck; or the master's metadata
    # lost, and rebuilt from the stores.
    accept_loss: bool = False
    # An intruder sending bad input through the servers' front doors.
    intruder: bool = False
    # With two masters or more: a client calling the standbys (`World._call_standbys`).
    standby_calls: bool = False
    # An operator asking for rolls now and then (`World._ask_rolls`).
    roll_asks: bool = False
    # With `operator`: it reads what the master shows all along (`read_side`).
    read_side: bool = False
    metadata_lost: bool = False
    loss_at_ms: int = 0
    # Followers of many streams through one subscription each (`with_many`).
    many: tuple[ManyFollower, ...] = ()
    # Spark jobs reading and writing through the data source (`with_analytics`).
    analytics: bool = False
    # A secured cluster (`with_security`): TLS, members and admins proving their
    # certificates on every call, tenants their tokens.
    secured: bool = False
    # Once converged and judged, bad input and operator calls at the servers' front
    # doors (`front_door.FrontDoor`), in plaintext.
    front_door: bool = False
    # Stores under pressure (`with_pressure`): their write queue's payload bytes, and
    # each tenant's append quota at each store, in bytes per second.
    queue_bytes_max: int = STORE_QUEUE_BYTES_MAX
    tenant_append_bytes_per_s: int = TENANT_APPEND_BYTES_PER_S_DEFAULT
    flaws: frozenset[str] = frozenset()

    @property
    def store_timeout_ms(self) -> int:
        return 2 * self.lease_ms

    @staticmethod
    def draw(seed: int, rng: random.Random, flaws: frozenset[str] = frozenset()) -> WorldConfig:
        replicas, quorum = rng.choice(((3, 2), (3, 2), (3, 3), (2, 1), (5, 3), (1, 1)))
        lease_ms = rng.choice((300, 600, 1200))
        append_timeout_ms = lease_ms * rng.choice((3, 5))
        stores = replicas + rng.choice((0, 0, 1, 2))
        fsync_never: tuple[str, ...] = ()
        if quorum > 1 and rng.random() < 1 / 3:
            names = [f"store{n}" for n in range(stores)]
            fsync_never = tuple(sorted(rng.sample(names, rng.randint(1, quorum - 1))))
        # What the generator gained later is drawn apart, so that adding it moved no
        # seed's schedule of what it drew before.
        later = random.Random(f"{seed}/later")
        masters = later.choice((0, 0, 1, 2, 3))
        operator = later.random() < OPERATOR_SHARE
        grace_ms = later.choice(OPERATOR_GRACES_MS) if operator else DELETE_GRACE_MS_DEFAULT
        tokens = later.random() < TOKENS_SHARE
        revoke_at_ms = later.randint(*REVOKE_AT_MS)
        revoked_token = later.randrange(3)
        answers_lost = 0
        if later.random() < REGISTRATION_ANSWERS_LOST_SHARE:
            answers_lost = later.choice((1, 2))
        rot = later.random() < ROT_SHARE
        config = WorldConfig(
            seed=seed,
            policy=ReplicationPolicy(replicas, quorum),
            stores=stores,
            processes=rng.choice((2, 3)),
            streams=rng.choice((2, 4, 8, 16)),
            rivals=rng.choice((0.0, 0.25, 1.0)),
            followers=rng.choice((1, 2)),
            faults=Faults.draw(rng),
            lease_ms=lease_ms,
            append_timeout_ms=append_timeout_ms,
            in_flight_max=rng.choice((1, 2, 4)),
            batch_max=rng.choice((1, 3, 8)),
            appends_per_s=rng.choice((10, 25, 50)),
            chaos_every_ms=lease_ms * rng.choice((1, 2, 4)),
            store_down_ms_max=append_timeout_ms * rng.choice((1, 3)),
            safety_ms=SAFETY_MS,
            segment_bytes=rng.choice((0, 0, 600, 3000)),
            fsync_never=fsync_never,
            # Lost registration answers need wiped stores.
            wipes=rng.random() < 0.25 or bool(answers_lost),
            masters=masters,
            operator=operator,
            delete_grace_ms=grace_ms,
            producers=draws_producers(seed),
            producer_batches_max=later.choice((1, 1, 4)),
            tokens=tokens,
            revoke_at_ms=revoke_at_ms,
            revoked_token=revoked_token,
            registration_answers_lost=answers_lost,
            rot=rot,
            flaws=flaws,
        )
        # Drawn apart again, so that the other seeds keep their schedules.
        crowded = random.Random(f"{seed}/crowds")
        if seed < CROWD_FIRST_SEED or crowded.random() >= CROWD_SHARE:
            config = config.with_losses(random.Random(f"{seed}/broken-disks"))
            intruded = random.Random(f"{seed}/malformed").random() < INTRUDER_SHARE
            reads = random.Random(f"{seed}/read-side").random() < READ_SIDE_SHARE
            standby_calls = random.Random(f"{seed}/standby-calls").random() < STANDBY_CALLS_SHARE
            rocksdb = random.Random(f"{seed}/rocksdb").random() < ROCKSDB_SHARE
            roll_asks = random.Random(f"{seed}/roll-asks").random() < ROLL_ASKS_SHARE
            config = dataclasses.replace(
                config,
                intruder=seed >= INTRUDER_FIRST_SEED and intruded,
                read_side=operator and reads,
                standby_calls=masters >= 2 and standby_calls,
                rocksdb=rocksdb,
                roll_asks=roll_asks,
            )
        else:
            processes = crowded.choice((1, 2))
            crowd = crowded.randint(*CROWD_STREAMS)
            config = dataclasses.replace(
                config,
                processes=processes,
                streams=processes * crowd,
                crowd=crowd,
                rivals=0.0,
                tokens=False,
                followers=1,
                safety_ms=CROWD_SAFETY_MS,
            )
        config = config.with_many(random.Random(f"{seed}/subscribe-many"))
        config = config.with_analytics(random.Random(f"{seed}/analytics"))
        config = config.with_security(random.Random(f"{seed}/tls"))
        config = config.with_pressure(random.Random(f"{seed}/pressure"))
        if random.Random(f"{seed}/send-buffer").random() < THIN_BUFFER_SHARE:
            config = dataclasses.replace(config, send_buffer_bytes=THIN_SEND_BUFFER_BYTES)
        # Once the run is judged: its draw moves nothing before. Not after a crowd, whose
        # nodes would make it cost minutes, nor in a secured cluster (its doors are
        # plaintext ones; `secured.probe` knocks at those of a secured cluster).
        front_door = random.Random(f"{seed}/front-door").random() < FRONT_DOOR_SHARE
        front_door = front_door and not config.crowd and not config.secured
        return dataclasses.replace(config, front_door=front_door)

    def with_losses(self, losses: random.Random) -> WorldConfig:
        """The situations of lost data, drawn from a generator of their own (so that
        a seed without them keeps its schedule): replicas destroyed for good, where the
        policy leaves a read quorum to lose (R > 1); or the master's metadata, where it
        can be rebuilt from the stores (`REBUILD_SHARE`)."""
        policy = self.policy
        roll = losses.random()
        loss_at_ms = losses.randint(*LOSS_AT_MS)
        if roll < ACCEPT_LOSS_SHARE:
            if policy.write_quorum == policy.replicas:
                return self
            # Neither wipes nor fsync never: a survivor losing its replica too would
            # leave a segment with none, which nothing can seal (docs/design.md, Known
            # gaps).
            return dataclasses.replace(
                self,
                accept_loss=True,
                loss_at_ms=loss_at_ms,
                wipes=False,
                registration_answers_lost=0,
                fsync_never=(),
            )
        if roll < ACCEPT_LOSS_SHARE + REBUILD_SHARE:
            if self.masters or self.tokens or self.operator:
                return self
            return dataclasses.replace(self, metadata_lost=True, loss_at_ms=loss_at_ms)
        return self

    def with_many(self, draws: random.Random) -> WorldConfig:
        """Followers of many streams (`MANY_SHARE`), drawn from a generator of their
        own (a seed without them keeps its schedule): one or two, each by a sample of
        the streams' names or by a tenant's prefix; in a crowd seed, one of every
        stream in place of the single follower."""
        if self.seed < MANY_FIRST_SEED or draws.random() >= MANY_SHARE:
            return self
        names = tuple(stream_names(self.streams))
        if self.crowd:
            everything = ManyFollower(names, None, draws.randint(*MANY_DROP_MS))
            if draws.random() < 0.5:
                everything = dataclasses.replace(everything, names=(), prefix="")
            return dataclasses.replace(self, followers=0, many=(everything,))
        many = []
        for _ in range(draws.choice((1, 1, 2))):
            drop_ms = draws.randint(*MANY_DROP_MS)
            if draws.random() < 0.5:
                sample = draws.sample(names, draws.randint(1, len(names)))
                many.append(ManyFollower(tuple(sorted(sample)), None, drop_ms))
            else:
                tenant = draws.randrange(min(3, self.streams))
                many.append(ManyFollower((), f"t{tenant}/", drop_ms))
        return dataclasses.replace(self, many=tuple(many))

    def with_analytics(self, draws: random.Random) -> WorldConfig:
        """Spark jobs (`ANALYTICS_SHARE`), drawn from a generator of their own (a seed
        without them keeps its schedule)."""
        if draws.random() >= ANALYTICS_SHARE or self.operator or self.accept_loss:
            return self
        return dataclasses.replace(self, analytics=True)

    def with_security(self, draws: random.Random) -> WorldConfig:
        """A secured cluster (`SECURED_SHARE`), drawn from a generator of its own: the
        schedule of a seed drawing it stays as it was until something refuses a caller
        (verifying a proof takes no virtual time). Spark's jobs call plaintext still."""
        if draws.random() >= SECURED_SHARE or self.analytics:
            return self
        return dataclasses.replace(self, secured=True)

    def with_pressure(self, draws: random.Random) -> WorldConfig:
        """Stores under pressure (`PRESSURE_SHARE`), drawn from a generator of their own
        (a seed without them keeps its schedule): a small write queue, a tenant's
        append quota, or both. Not where the master's metadata is lost: a stream whose
        first writes the stores refused and whose card reached none is lost with it, the
        rebuild's known gap (docs/design.md), which pressure makes likely (seed 4989)."""
        if draws.random() >= PRESSURE_SHARE or self.metadata_lost:
            return self
        kind = draws.choice(PRESSURE_KINDS) if not self.crowd else "busy"
        queue_bytes_max = draws.choice(PRESSED_QUEUE_BYTES)
        bytes_per_s = draws.choice(PRESSED_APPEND_BYTES_PER_S)
        return dataclasses.replace(
            self,
            queue_bytes_max=queue_bytes_max if kind != "quota" else self.queue_bytes_max,
            tenant_append_bytes_per_s=(
                bytes_per_s if kind != "busy" else self.tenant_append_bytes_per_s
            ),
        )

    @property
    def pressed(self) -> bool:
        """Whether the stores are under pressure (`with_pressure`)."""
        return (
            self.queue_bytes_max != STORE_QUEUE_BYTES_MAX
            or self.tenant_append_bytes_per_s != TENANT_APPEND_BYTES_PER_S_DEFAULT
        )

    def describe(self) -> str:
        f = self.faults
        return (
            f"seed {self.seed}: N={self.policy.replicas} W={self.policy.write_quorum} "
            f"stores={self.stores} processes={self.processes} streams={self.streams} "
            f"rivals={self.rivals} followers={self.followers} lease={self.lease_ms}ms "
            f"append timeout={self.append_timeout_ms}ms loss={f.loss} dup={f.duplicate} "
            f"delay<={f.delay_ms_max}ms slow={f.slow}/{f.slow_delay_ms_max}ms "
            f"in flight<={self.in_flight_max} batch<={self.batch_max} "
            f"{self.appends_per_s} appends/s chaos/{self.chaos_every_ms}ms "
            f"store down<={self.store_down_ms_max}ms roll at {self.segment_bytes or '-'}B"
            + (f" fsync-never={list(self.fsync_never)}" if self.fsync_never else "")
            + (" wipes" if self.wipes else "")
            + (" intruder" if self.intruder else "")
            + (" standby-calls" if self.standby_calls else "")
            + (" roll-asks" if self.roll_asks else "")
            + (" rocksdb" if self.rocksdb else "")
            + (
                f" send-buffer={self.send_buffer_bytes}B"
                if self.send_buffer_bytes != SEND_BUFFER_BYTES_DEFAULT
                else ""
            )
            + (f" masters={self.masters} on etcd" if self.masters else "")
            + (f" operator (grace {self.delete_grace_ms}ms)" if self.operator else "")
            + (" reading all along" if self.read_side else "")
            + (" producers" if self.producers else "")
            + (
                f" pipelined<={self.producer_batches_max}"
                if self.producers and self.producer_batches_max > 1
                else ""
            )
            + (
                f" tokens of {TOKEN_TENANT} (#{self.revoked_token} revoked at "
                f"{self.revoke_at_ms}ms)"
                if self.tokens
                else ""
            )
            + (
                f" {self.registration_answers_lost} registration answers lost per wipe"
                if self.registration_answers_lost
                else ""
            )
            + (" rot, scrubbed" if self.rot else "")
            + (" (bits flipped only)" if self.rot and not self.forges else "")
            + (f" crowds of {self.crowd} streams per process" if self.crowd else "")
            + (f" replicas destroyed at {self.loss_at_ms}ms" if self.accept_loss else "")
            + (f" metadata lost at {self.loss_at_ms}ms" if self.metadata_lost else "")
            + "".join(
                f" subscribe_many({many.describe()}, drops<={many.drop_ms}ms)" for many in self.many
            )
            + (" spark jobs" if self.analytics else "")
            + (" secured" if self.secured else "")
            + (
                f" write queue {self.queue_bytes_max}B"
                if self.queue_bytes_max != STORE_QUEUE_BYTES_MAX
                else ""
            )
            + (
                f" quota {self.tenant_append_bytes_per_s}B/s per tenant"
                if self.tenant_append_bytes_per_s != TENANT_APPEND_BYTES_PER_S_DEFAULT
                else ""
            )
            + (" front door" if self.front_door else "")
            + (f" flaws={sorted(self.flaws)}" if self.flaws else "")
        )


# The share of seeds whose writers append with producer ids. Drawn from a randomness of
# its own, so that a seed without producers runs as it did before producers existed
# (the schedules its regression tests pin stay theirs).
PRODUCER_SEEDS_SHARE = 0.5


def draws_producers(seed: int) -> bool:
    """Whether seed `seed`'s writers append with producer ids."""
    return random.Random(f"producers:{seed}").random() < PRODUCER_SEEDS_SHARE


@dataclass
class ProducerOutbox:
    """What a client process produced with its producer id and has not yet seen acked:
    it keeps it across its writers, as an application keeps its events until they are
    confirmed, and resends them through the next writer from the lowest."""

    # Unconfirmed events by producer sequence; the next sequence to give out.
    events: dict[int, bytes] = field(default_factory=dict)
    next_sequence: int = 0
    # Sequences given to the current writer: not resent while it leads.
    in_flight: set[int] = field(default_factory=set)
    # Batches out at once (pipelined producers), and whether one of them failed: then
    # no new batch goes until none is out, and the next resends every unconfirmed event
    # from the lowest.
    batches_out: int = 0
    resend: bool = False


# What a store losing acked entries (fsync never) can break: reads (1, 2), sealed
# replicas (4), and convergence (0, a bridge lost everywhere it was held). Fencing (3),
# the master (5) and bad input (6) never rest on a store's durability.
LOSS_CAN_BREAK = frozenset({0, 1, 2, 4})


def is_documented_loss(violation: Violation | None, unsynced_losses: list[str]) -> bool:
    """A violation after stores with fsync never lost acked entries in a restart, of an
    invariant such a loss can break: the documented loss, not a broken invariant."""
    return violation is not None and bool(unsynced_losses) and violation.invariant in LOSS_CAN_BREAK


def run_outcome(violation: Violation | None, unsynced_losses: list[str], error: str) -> str:
    """How a run ended, in a word and its reason."""
    if is_documented_loss(violation, unsynced_losses):
        return f"DOCUMENTED LOSS (fsync never: {unsynced_losses[0]}) {violation}"
    if violation is not None:
        return f"VIOLATION {violation}"
    if error:
        return f"ERROR {error.strip().splitlines()[-1]}"
    return "ok"


@dataclass
class WorldResult:
    config: WorldConfig
    virtual_ms: int = 0
    acked: int = 0
    read: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    error: str = ""
    trace: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    unsynced_losses: list[str] = field(default_factory=list)

    @property
    def documented_loss(self) -> bool:
        return is_documented_loss(self.violation, self.unsynced_losses)

    @property
    def ok(self) -> bool:
        return (self.violation is None or self.documented_loss) and not self.error

    def summary(self) -> str:
        outcome = run_outcome(self.violation, self.unsynced_losses, self.error)
        return (
            f"seed {self.config.seed}: {outcome}; {self.virtual_ms} ms virtual, "
            f"{self.acked} events acked, {self.read} read, {self.seconds * 1000:.0f} ms"
        )


@dataclass
class Process:
    """A client process: its streams, and its incarnation (each is its own node)."""

    name: str
    streams: tuple[str, ...]
    incarnation: int = 1

    @property
    def node(self) -> str:
        return f"{self.name}.{self.incarnation}"


Subscription = AsyncGenerator[StreamEvent, None]


class Masters:
    """The cluster's masters: one on in-memory metadata (`WorldConfig.masters` 0), run
    as a world node and restarted over the same metadata, or 1-3 elected on an etcd
    (`SimElectedMaster` on `SimEtcd`, each its own process), which `checker` watches."""

    def __init__(
        self,
        network: SimNetwork,
        config: WorldConfig,
        disk_root: Path | None = None,
        certs: ClusterCerts | None = None,
    ) -> None:
        lease_ms, store_timeout_ms = config.lease_ms, config.store_timeout_ms
        grace_ms = config.delete_grace_ms
        self.embedded: SimMaster | None = None
        self.etcd: SimEtcd | None = None
        self.elected: list[SimElectedMaster] = []
        if config.masters:
            self.etcd = SimEtcd(network)
            self.elected = [
                SimElectedMaster(
                    network,
                    f"m{n}",
                    self.etcd.url(),
                    lease_ms,
                    store_timeout_ms,
                    delete_grace_ms=grace_ms,
                    console=config.read_side,
                    certs_dir=None if certs is None else certs.node_dir(f"m{n}"),
                    tenant_append_bytes_per_s=config.tenant_append_bytes_per_s,
                )
                for n in range(1, config.masters + 1)
            ]
            self.checker = MasterChecker(parse_etcd_url(self.etcd.url()))
        else:
            self.embedded = SimMaster(
                network,
                "master",
                lease_ms,
                store_timeout_ms,
                grace_ms,
                console=config.read_side,
                disk=None if disk_root is None else disk_root / "master",
                certs_dir=None if certs is None else certs.node_dir("master"),
                tenant_append_bytes_per_s=config.tenant_append_bytes_per_s,
            )
            self.checker = MasterChecker()
        self.lease_ms = config.lease_ms

    @property
    def address(self) -> str:
        """What stores and clients are given: every master's address."""
        if self.embedded is not None:
            return self.embedded.address
        return ",".join(master.address for master in self.elected)

    @property
    def names(self) -> list[str]:
        """The masters' nodes (and etcd's)."""
        if self.embedded is not None:
            return [self.embedded.name]
        assert self.etcd is not None
        return [master.name for master in self.elected] + [self.etcd.name]

    def active(self) -> list[SimElectedMaster]:
        now = wall_ms()
        return [master for master in self.elected if master.active(now)]

    @property
    def state(self) -> MasterState | None:
        """What the master serves from: the embedded one's (kept while it restarts, no
        other changes it; None while it rebuilds its metadata, when it serves the stores
        alone), or the active elected one's (None while none is)."""
        if self.embedded is not None:
            return None if self.embedded.rebuilding else self.embedded.state
        active = self.active()
        return active[0].state if len(active) == 1 else None

    def look(self) -> None:
        """Invariant 5 across masters (`MasterChecker.look`)."""
        active = self.active()
        if self.embedded is not None:
            self.checker.look([self.embedded.name], self.state, self.lease_ms)
        else:
            self.checker.look([m.name for m in active], self.state, self.lease_ms)


class World:
    """One seed's cluster, workload, nemesis and checkers: see the module doc."""

    def __init__(
        self,
        config: WorldConfig,
        rng: random.Random,
        network: SimNetwork,
        group: asyncio.TaskGroup,
        trace: Callable[[str], None] | None,
    ) -> None:
        self.config = config
        self.rng = rng
        self.network = network
        self.loop = network.loop
        self.group = group
        self._trace = trace
        self.lines: list[str] = []
        # With `WorldConfig.rocksdb`: the directory of the run's databases.
        self.disk_root: Path | None = None
        if config.rocksdb:
            self.disk_root = Path(tempfile.mkdtemp(prefix="streamengine-sim-", dir=ROCKSDB_ROOT))
        self.certs = cluster_certs() if config.secured else None
        # A secured store keeps the revoked certificates in its data dir.
        self.data_root: Path | None = None
        if self.certs is not None:
            self.data_root = Path(tempfile.mkdtemp(prefix="streamengine-sim-data-"))
        self.masters = Masters(network, config, self.disk_root, self.certs)
        if self.masters.etcd is not None:
            self.masters.etcd.txn_observers.append(self._commit_applied)
        self.stores = {
            name: SimStore(
                network,
                name,
                master_address=self.masters.address,
                data_dir=SIM_DATA_DIR if self.data_root is None else self.data_root / name,
                fsync=name not in config.fsync_never,
                scrub_recheck_ms=SCRUB_RECHECK_MS if config.rot else 0,
                disk=self._disk(name),
                certs_dir=None if self.certs is None else self.certs.node_dir(name),
                queue_bytes_max=config.queue_bytes_max,
            )
            for name in (f"store{n}" for n in range(config.stores))
        }
        self.stream_names = stream_names(config.streams)
        self.processes = [Process(f"c{n}", ()) for n in range(1, config.processes + 1)]
        self._assign_streams()
        self.nodes: dict[str, asyncio.Task[None]] = {}
        self.checkers: dict[str, Checker] = {}
        self.checkers_by_id: dict[int, Checker] = {}
        self.phase = "setup"
        self.violation: Violation | None = None
        self.finished = asyncio.Event()
        self.markers: dict[str, bytes] = {}  # stream -> its acked liveness marker
        # Streams the operator deleted and undeleted too late: the master removed them
        # (their undelete answered NOT_FOUND), a loss the operator asked for.
        self.removed: set[str] = set()
        self.acked_at_convergence: dict[str, frozenset[int]] = {}
        self.wiped: set[str] = set()
        # Client process nodes that crashed: their appends answer nobody any more.
        self.crashed: set[str] = set()
        # Streams whose liveness marker is being appended.
        self.marking: set[str] = set()
        # Every writer by its client id, for what a report says of it.
        self.writers: dict[str, Writer] = {}
        self.stats: dict[str, int] = {}
        self._payloads = 0
        # With `WorldConfig.producers`: what each process produced for each stream and
        # was not told is in it, kept across its writers and incarnations (an
        # application keeps its events until confirmed).
        self.outboxes: dict[str, ProducerOutbox] = {}
        # Producer events sent in a call that ended without an answer: they go again.
        self.unanswered: set[bytes] = set()
        # With `WorldConfig.tokens`: each process's token of `TOKEN_TENANT` (its text and
        # its id), the process whose token the operator revoked, and the producer
        # events sent at least once (a resend may be durable from before).
        self.tokens: dict[str, tuple[str, str]] = {}
        self.revoked_process = ""
        self.produced_sent: set[bytes] = set()
        # What each wiped store held before its wipes: the replicas its new incarnation
        # must never stand for.
        self.held_before_wipe: dict[str, set[SegmentKey]] = {}
        # With `WorldConfig.rot`: rotted replicas not yet sound again, when each rotted,
        # and those the scrub has found.
        self.rotten: dict[tuple[str, SegmentKey], int] = {}
        self.rot_found: set[tuple[str, SegmentKey]] = set()
        # Which rot events forge a copy (`FORGE_SHARE`), and the replicas forged.
        self.forge_draws = random.Random(f"{config.seed}/forge")
        self.forged: set[tuple[str, SegmentKey]] = set()
        # With `WorldConfig.accept_loss`: the streams whose processes the operator
        # stopped to seal them accepting loss, each with an event set once it is done
        # (no process leads them meanwhile); and where each follower goes on in a
        # stream after a `DataLossError` it was told.
        self.held_off: dict[str, asyncio.Event] = {}
        self.analyst = Analyst(self) if config.analytics else None
        self.resume_at: dict[tuple[str, str], int] = {}
        network.call_observers.append(self._call_ended)
        if self.masters.embedded is not None:
            self.masters.embedded.rebuild_observers.append(self._rebuilt)
        # Streams the operator creates once the metadata was rebuilt (their ids must be
        # new).
        self.created_after_rebuild: list[str] = []
        # Rolls the active master owes a leader, (stream, epoch): when first seen (the
        # writers' clock), and the state they were seen in (`_rolls_heard`).
        self._owed_rolls_since: dict[tuple[str, int], int] = {}
        self._owed_rolls_of: MasterState | None = None
        # Dials a cut left unanswered when it healed: (when, client's node, server's
        # node, the dials) (`_healed_cuts_crossed`).
        self._healed_dials: list[tuple[float, str, str, frozenset[asyncio.Future[Any]]]] = []
        for name, store in self.stores.items():
            store.join_observers.append(functools.partial(self._store_joined, name))
            store.command_observers.append(functools.partial(self._store_planned, name))

    def _disk(self, store: str) -> Path | None:
        """Where `store` keeps its RocksDB, if it does."""
        if self.disk_root is None or store in self.config.fsync_never:
            return None
        return self.disk_root / store

    def close_disks(self) -> None:
        """The run is over: every database is closed and the run's directory removed."""
        if self.data_root is not None:
            shutil.rmtree(self.data_root, ignore_errors=True)
        if self.disk_root is None:
            return
        for store in self.stores.values():
            store.close_disk()
        if self.masters.embedded is not None:
            self.masters.embedded.close_disk()
        shutil.rmtree(self.disk_root, ignore_errors=True)

    def _assign_streams(self) -> None:
        """Each stream has a leading process; a share of them a rival one too."""
        wanted: dict[str, list[str]] = {p.name: [] for p in self.processes}
        names = [p.name for p in self.processes]
        for n, stream in enumerate(self.stream_names):
            first = names[n % len(names)]
            wanted[first].append(stream)
            if self.rng.random() < self.config.rivals:
                rival = self.rng.choice([name for name in names if name != first])
                wanted[rival].append(stream)
        if self.config.tokens:
            # Every stream of the tenant has a rival: one token revoked, another leads.
            for n, stream in enumerate(self.stream_names):
                leading = [name for name in names if stream in wanted[name]]
                if self._under_token(stream) and len(leading) < 2:
                    wanted[names[(n + 1) % len(names)]].append(stream)
        for process in self.processes:
            process.streams = tuple(wanted[process.name])

    @staticmethod
    def _under_token(stream: str) -> bool:
        return stream.startswith(f"{TOKEN_TENANT}/")

    # ---- plumbing ----

    @property
    def now_ms(self) -> int:
        return round(self.loop.elapsed_s() * 1000)

    def note(self, text: str) -> None:
        line = f"{self.now_ms:>7} {text}"
        self.lines.append(line)
        if self._trace is not None:
            self._trace(line)

    def count(self, what: str, times: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + times

    def check(self, call: Callable[..., object], *args: Any) -> bool:
        """`call(*args)`, a check; the first violation ends the run. False once one did."""
        if self.violation is not None:
            return False
        try:
            call(*args)
        except Violation as violation:
            self.violation = violation
            self.note(f"VIOLATION {violation}")
            self.finished.set()
            return False
        return True

    def _commit_applied(self, *commit: Any) -> None:
        self.check(self.masters.checker.commit_applied, *commit)

    def client(self, process: str = "") -> StreamClient:
        """A client of the cluster, as the admin: over TLS with client process
        `process`'s certificate, or the operator's (`client.root`), in a secured one."""
        if self.certs is None:
            return StreamClient(self.masters.address)
        if process:
            return StreamClient.from_transport(self.masters.address, self.certs.process(process))
        return StreamClient(self.masters.address, certs_dir=self.certs.admin_dir)

    def tenant_transport(self, token: str) -> Transport:
        """A tenant's transport: its token (over TLS with the CA, when secured)."""
        return Transport(token=token) if self.certs is None else self.certs.tenant(token)

    def admin_transport(self) -> Transport:
        """The operator's transport (`client.root`, when secured)."""
        if self.certs is None:
            return Transport()
        return Transport.for_client(self.certs.admin_dir)

    def start(self, node: str, serve: Coroutine[Any, Any, None]) -> None:
        self.nodes[node] = self.group.create_task(serve, context=node_context(node))

    async def stop(self, node: str) -> None:
        task = self.nodes.pop(node)
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def stop_all(self) -> None:
        """End every node; a node still running `STOP_MS_MAX` later is a world error
        (its loop does not end when cancelled)."""
        self.phase = "stopped"
        processes = [*self.masters.elected, *filter(None, [self.masters.etcd])]
        tasks = list(self.nodes.values()) + [p.task for p in processes if p.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=STOP_MS_MAX / 1000)
            if running:
                raise RuntimeError(f"nodes still running after being stopped: {running}")

    def next_payloads(self, writer_id: str, count: int) -> tuple[bytes, ...]:
        payloads = []
        for _ in range(count):
            self._payloads += 1
            payloads.append(f"{writer_id}:{self._payloads}".encode())
        return tuple(payloads)

    # ---- the run ----

    async def run(self) -> None:
        await self._set_up()
        self.phase = "safety"
        self.network.faults = self.config.faults
        for process in self.processes:
            self.start(process.node, self._process(process))
        for n in range(1, self.config.followers + 1):
            self.start(f"r{n}", self._follower(f"r{n}"))
        for name, many in self._many_followers():
            self.start(name, self._follower_of_many(name, many))
        self.start("nemesis", self._nemesis())
        self.start("watch", self._watch())
        if self.config.operator:
            self.start("operator", self._operator())
        if self.config.roll_asks:
            self.start("roller", self._ask_rolls())
        if self.config.read_side:
            self.start("read-side", ReadSide(self, TOKEN_TENANT).run())
        if self.config.tokens:
            self.start("revoker", self._revoke_token())
        if self.config.rot:
            self.start("rot", self._rot())
        if self.config.accept_loss:
            self.start("destroyer", self._destroy_replicas())
        if self.config.metadata_lost:
            self.start("master-disk", self._lose_metadata())
        if self.config.intruder:
            self.start("intruder", self._intrude())
        if self.config.standby_calls:
            self.start("standby-caller", self._call_standbys())
        if self.analyst is not None:
            self.start("analyst", self.analyst.run())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.safety_ms / 1000):
                await self.finished.wait()
        if self.violation is not None:
            return
        await self._start_liveness()
        try:
            async with asyncio.timeout(LIVENESS_MS / 1000):
                await self.finished.wait()
        except TimeoutError:
            self.check(self._raise_stuck)
        if self.violation is None and self.rotten:
            await self._wait_for_repairs()
        if self.violation is None:
            self._audit_all()
            for stream, checker in sorted(self.checkers.items()):
                acked = self.acked_at_convergence.get(stream)
                self.check(checker.check_complete, self._followers_of(stream), acked)
        if self.violation is None and self.analyst is not None:
            await self._last_spark_jobs(self.analyst)
        if self.violation is None and self.certs is not None:
            await secured.probe(self)
        if self.violation is None and self.config.front_door:
            await self._front_door()

    async def _last_spark_jobs(self, analyst: Analyst) -> None:
        """Once the world converged, the analyst's last jobs end (`Analyst.final`)."""
        # Not in the world's group, whose first failure would end the run as an error.
        task = self.loop.create_task(analyst.final(), context=node_context("analyst"))
        await asyncio.wait([task])
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, TimeoutError):
            self.check(self._raise, Violation(0, "the last Spark jobs did not end once converged"))
        elif isinstance(error, Violation):
            self.check(self._raise, error)
        elif error is not None:
            raise error

    async def _front_door(self) -> None:
        """Once the run is judged, its front door (`front_door.FrontDoor`); then the
        stores audited again."""
        read_side = self.nodes.get("read-side")
        if read_side is not None:
            # Its last create, delete or seal may still be under way (within its
            # `ACTION_S_MAX`): the front door's callers must find nothing moving (seed
            # 2498: d0/x6 created 500 ms into the front door).
            await asyncio.wait([read_side])
        self.note("front door: bad input and operator calls at the converged cluster")
        task = self.loop.create_task(FrontDoor(self).run(), context=node_context("front-door"))
        await asyncio.wait([task])
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, Violation):
            self.check(self._raise, error)
        elif error is not None:
            raise error
        if self.violation is None:
            self._audit_all()

    async def _set_up(self) -> None:
        await self._start_masters()
        for name, store in self.stores.items():
            self.start(name, store.serve())
        async with asyncio.timeout(SETUP_MS_MAX / 1000):
            await wait_until(self._joined, timeout_s=SETUP_MS_MAX / 1000)
            await self.group.create_task(self._create_streams(), context=node_context("setup"))
            if self.config.tokens:
                await self.group.create_task(self._create_tokens(), context=node_context("setup"))
        state = self.masters.state
        assert state is not None
        for stream in self.stream_names:
            stream_id = state.streams[stream].stream_id
            self.checkers[stream] = Checker(stream_id, self.config.append_timeout_ms)
            self.checkers_by_id[stream_id] = self.checkers[stream]
        self.note(f"{len(self.stores)} stores joined; {len(self.stream_names)} streams created")

    async def _start_masters(self) -> None:
        masters = self.masters
        if masters.embedded is not None:
            self.start(masters.embedded.name, masters.embedded.serve())
            return
        assert masters.etcd is not None
        masters.etcd.start(self.group)
        await masters.etcd.serving.wait()
        # One at a time: the first started is the first active (its key is the oldest).
        for master in masters.elected:
            master.start(self.group)
            await wait_until(lambda: bool(masters.active()), SETUP_MS_MAX / 1000, "a master active")

    async def _create_streams(self) -> None:
        async with self.client() as client:
            for stream in self.stream_names:
                await client.create_stream(
                    stream,
                    replicas=self.config.policy.replicas,
                    write_quorum=self.config.policy.write_quorum,
                    segment_bytes=self.config.segment_bytes,
                )

    async def _create_tokens(self) -> None:
        """A write token of `TOKEN_TENANT` for each client process, as `streamengine
        token create` asks for one."""
        async with self.client() as client:
            for process in self.processes:
                request = master_pb2.CreateTokenRequest(
                    tenant=TOKEN_TENANT, role=master_pb2.TOKEN_ROLE_WRITE
                )
                reply = await client.master.CreateToken(request, timeout=OPERATOR_CALL_S)
                self.tokens[process.name] = (reply.token, reply.token_id)

    def _joined(self) -> bool:
        state = self.masters.state
        if state is None:
            return False
        alive = [view.alive for view in state.store_views(wall_ms()).values()]
        return alive.count(True) == len(self.stores) and all(
            store.core is not None and store.core.catalog.cluster_id()
            for store in self.stores.values()
        )

    # ---- client processes: writers ----

    @property
    def _append_every_ms(self) -> int:
        """Per writer, at most: `appends_per_s` over all streams, twice on average; in
        a crowd seed, `CROWD_APPEND_EVERY_MS` (a few batches per stream)."""
        if self.config.crowd:
            return CROWD_APPEND_EVERY_MS
        return max(1, 2 * 1000 * len(self.stream_names) // self.config.appends_per_s)

    async def _process(self, process: Process) -> None:
        """The process's streams, led through its client; those of `TOKEN_TENANT`, with
        `WorldConfig.tokens`, through a second client calling with its token."""
        token = self.tokens.get(process.name)
        while self.phase != "stopped":
            try:
                async with contextlib.AsyncExitStack() as stack:
                    client = await stack.enter_async_context(self.client(process.name))
                    tenant_client = client
                    if token is not None:
                        tenant_client = await stack.enter_async_context(
                            StreamClient.from_transport(
                                self.masters.address, self.tenant_transport(token[0])
                            )
                        )
                    tasks = await stack.enter_async_context(asyncio.TaskGroup())
                    for stream in process.streams:
                        chosen = tenant_client if self._under_token(stream) else client
                        tasks.create_task(self._lead(process, chosen, stream))
            except StreamEngineError as error:  # no first contact: the master is away
                self.count(f"process {type(error).__name__}")
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    async def _lead(self, process: Process, client: StreamClient, stream: str) -> None:
        attempt = 0
        while self.phase != "stopped" and stream not in self.removed:
            if stream in self.held_off:
                await self.held_off[stream].wait()
            attempt += 1
            writer_id = f"{process.node}/{stream}#{attempt}"
            try:
                async with client.writer(
                    stream,
                    client_id=writer_id,
                    append_timeout_s=self.config.append_timeout_ms / 1000,
                    producer_id=self._producer_id(process, stream),
                ) as writer:
                    self.writers[writer_id] = writer
                    self.note(f"{writer_id} leads epoch {writer.epoch}")
                    await self._write(writer, writer_id, self.checkers[stream], stream)
            except PermissionDenied as error:
                # Its token was revoked: this process leads the stream no more (a new
                # token would make a new writer); it waits to be stopped.
                self.note(f"{writer_id} ends: {type(error).__name__}: {error}; it stops")
                self.count("writers refused for their token")
                await asyncio.get_running_loop().create_future()
            except StreamEngineError as error:
                self.note(f"{writer_id} ends: {type(error).__name__}: {error}")
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    async def _write(self, writer: Writer, writer_id: str, checker: Checker, stream: str) -> None:
        """Append batches, up to `in_flight_max` at once, until leadership ends."""
        lost = asyncio.Event()
        in_flight = asyncio.Semaphore(self.config.in_flight_max)
        # The first append at once: until a segment's first write reaches its stores,
        # readers of the stream find it nowhere and ask again and again.
        pause_ms = 0
        async with asyncio.TaskGroup() as appends:
            while not lost.is_set():
                await asyncio.sleep(pause_ms / 1000)
                pause_ms = self.rng.randint(1, self._append_every_ms)
                if self.phase == "liveness":
                    if stream in self.markers or stream in self.marking:
                        continue
                    self.marking.add(stream)
                    payloads: tuple[bytes, ...] = (f"marker:{writer_id}:{self.now_ms}".encode(),)
                elif writer.producer_id is not None:
                    self._produce(writer, writer_id, checker, lost, appends)
                    continue
                else:
                    count = self.rng.randint(1, self.config.batch_max)
                    payloads = self.next_payloads(writer_id, count)
                await in_flight.acquire()
                appends.create_task(
                    self._append(writer, writer_id, checker, stream, payloads, lost, in_flight)
                )
        if writer.leading:
            return
        raise LeadershipLost(f"{writer_id}: no longer leads")

    async def _append(
        self,
        writer: Writer,
        writer_id: str,
        checker: Checker,
        stream: str,
        payloads: tuple[bytes, ...],
        lost: asyncio.Event,
        in_flight: asyncio.Semaphore,
    ) -> None:
        self.check(checker.append_started, writer_id, payloads, self.now_ms)
        if self._revoked_everywhere(writer_id):
            self.check(checker.sent_under_revoked_token, payloads)
        try:
            sequences = await writer.append_batch(payloads)
        except StreamEngineError as error:
            self.check(checker.append_ended, writer_id, payloads)
            self._append_failed(checker, writer_id, payloads, error, lost)
            if not writer.leading:  # it stepped down for another reason (StreamDeleted)
                lost.set()
            return
        finally:
            in_flight.release()
            if payloads[0].startswith(b"marker:"):
                self.marking.discard(stream)
        self.check(checker.append_ended, writer_id, payloads)
        if self.revoked_process and self._under_token(stream):
            revoked = writer_id.partition(".")[0] == self.revoked_process
            self.count(f"acked under the {'revoked token' if revoked else 'other tokens'}")
        state = self.masters.state
        for sequence, payload in zip(sequences, payloads, strict=True):
            epoch, index = unpack_sequence(sequence)
            if not self.check(checker.user_acked, epoch, index, payload, state):
                return
        if payloads[0].startswith(b"marker:"):
            self.markers[stream] = payloads[0]
            self.note(f"{writer_id} marker acked at {unpack_sequence(sequences[0])}")
            self._check_converged()

    def _producer_id(self, process: Process, stream: str) -> str | None:
        """The producer id of `process` on `stream` (None: a plain writer)."""
        return f"{process.name}:{stream}" if self.config.producers else None

    def _produce(
        self,
        writer: Writer,
        writer_id: str,
        checker: Checker,
        lost: asyncio.Event,
        appends: asyncio.TaskGroup,
    ) -> None:
        """New events of the writer's producer; unless its last batch is still out, one
        batch of every event not yet confirmed, from the lowest sequence (the stream
        answers those it holds from its table and writes the rest)."""
        assert writer.producer_id is not None
        out = self.outboxes.setdefault(writer.producer_id, ProducerOutbox())
        for _ in range(self.rng.randint(1, self.config.batch_max)):
            out.events[out.next_sequence] = f"p:{writer.producer_id}:{out.next_sequence}".encode()
            out.next_sequence += 1
        if out.batches_out and (out.resend or out.batches_out >= self.config.producer_batches_max):
            return
        # From the lowest unconfirmed event (the next after those out, if any), as many
        # as run on without a gap: a batch answered after an earlier one failed in doubt
        # leaves a gap, and a batch's events take consecutive sequences.
        after = max(out.in_flight) if out.batches_out else -1
        pending = sorted(sequence for sequence in out.events if sequence > after)
        if not pending:
            return
        sequences = [pending[0]]
        for sequence in pending[1:]:
            if sequence != sequences[-1] + 1:
                break
            sequences.append(sequence)
        out.in_flight.update(sequences)
        out.batches_out += 1
        appends.create_task(self._append_produced(writer, writer_id, checker, out, lost, sequences))

    async def _append_produced(
        self,
        writer: Writer,
        writer_id: str,
        checker: Checker,
        out: ProducerOutbox,
        lost: asyncio.Event,
        sequences: list[int],
    ) -> None:
        payloads = tuple(out.events[sequence] for sequence in sequences)
        self.check(checker.append_started, writer_id, payloads, self.now_ms)
        if self.config.tokens:
            # An event sent before may be durable from then: only the new ones are
            # held to the revocation.
            fresh = tuple(p for p in payloads if p not in self.produced_sent)
            self.produced_sent.update(payloads)
            if fresh and self._revoked_everywhere(writer_id):
                self.check(checker.sent_under_revoked_token, fresh)
        try:
            answered = await writer.append_batch(payloads, producer_sequence=sequences[0])
        except StreamEngineError as error:
            # Not given up: every event goes again with the next batch, or writer.
            self.check(checker.append_ended, writer_id, payloads)
            self.unanswered.update(payloads)
            self.count(f"producer {type(error).__name__}")
            out.resend = True
            if isinstance(error, LeadershipLost) or not writer.leading:
                lost.set()
            return
        finally:
            out.in_flight.difference_update(sequences)
            out.batches_out -= 1
            if not out.batches_out:
                out.resend = False
        self.check(checker.append_ended, writer_id, payloads)
        state = self.masters.state
        for producer_sequence, sequence, payload in zip(sequences, answered, payloads, strict=True):
            del out.events[producer_sequence]
            if sequence == 0:  # durable, its position no longer kept
                self.count("producer events answered 0")
                if self._answered_written_is_read:
                    self.check(checker.producer_answered_written, payload)
                continue
            epoch, index = unpack_sequence(sequence)
            if not self.check(checker.user_acked, epoch, index, payload, state):
                return
        resent = self.unanswered.intersection(payloads)
        self.unanswered -= resent
        self.count("producer events acked", len(payloads))
        self.count("producer events resent and acked", len(resent))

    @property
    def _answered_written_is_read(self) -> bool:
        """Whether a producer event answered as durable at a position the table no
        longer keeps (sequence 0) must be read by the end (invariant 15): not where the
        operator trims (a trim may take it before a follower reads it, and its position
        is unknown) nor where an operator's seal declares a loss (which may take it)."""
        return not self.config.operator and not self.config.accept_loss

    def _revoked_everywhere(self, writer_id: str) -> bool:
        """Whether `writer_id` writes under a token every store serves knowing it is
        revoked: then no store may take what it sends from now on."""
        process, _, rest = writer_id.partition("/")
        if not self.revoked_process or process.partition(".")[0] != self.revoked_process:
            return False
        if not self._under_token(rest.partition("#")[0]):
            return False
        token_id = self.tokens[self.revoked_process][1]
        return all(
            store.serving.is_set()
            and store.context is not None
            and token_id in store.context.authority.revocations
            for store in self.stores.values()
        )

    def _call_ended(
        self, client_node: str, address: str, method: str, code: grpc.StatusCode
    ) -> None:
        if (
            method == STORE_WRITE
            and self.revoked_process
            and client_node.partition(".")[0] == self.revoked_process
            and code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        ):
            self.count(f"revoked token: Write {code.name}")

    async def _revoke_token(self) -> None:
        """The operator revokes one process's token (`streamengine token revoke`),
        trying again until the master answers."""
        await asyncio.sleep(self.config.revoke_at_ms / 1000)
        if self.phase != "safety":
            return
        process = self.processes[self.config.revoked_token % len(self.processes)].name
        self.revoked_process = process
        request = master_pb2.RevokeTokenRequest(token_id=self.tokens[process][1])
        while self.phase != "stopped":
            if await self._operate(f"revoke the token of {process}", request, retried=True):
                return
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    def _append_failed(
        self,
        checker: Checker,
        writer_id: str,
        payloads: tuple[bytes, ...],
        error: StreamEngineError,
        lost: asyncio.Event,
    ) -> None:
        self.count(type(error).__name__)
        definitely_failed = isinstance(error, AppendFailed) or (
            isinstance(error, AppendTimedOut) and not error.in_doubt
        )
        if definitely_failed:
            self.check(checker.appends_failed, list(payloads))
        if isinstance(error, LeadershipLost):
            lost.set()

    # ---- followers ----

    async def _follower(self, name: str) -> None:
        while self.phase != "stopped":
            try:
                async with (
                    self.client() as client,
                    asyncio.TaskGroup() as tasks,
                ):
                    for stream in self.stream_names:
                        tasks.create_task(self._follow(name, client, stream))
            except StreamEngineError as error:  # no first contact: the master is away
                self.count(f"follower {type(error).__name__}")
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    async def _follow(self, name: str, client: StreamClient, stream: str) -> None:
        checker = self.checkers[stream]
        while self.phase != "stopped" and stream not in self.removed:
            record = checker.followers.get(name)
            start = max(record.last + 1, record.trimmed_before) if record else 0
            start = max(start, self.resume_at.get((name, stream), 0))
            try:
                async with contextlib.aclosing(
                    cast(Subscription, client.subscribe(stream, start=start))
                ) as events:
                    async for event in events:
                        self.check(checker.follower_event, name, event.sequence, event.payload)
                        if self.phase == "liveness":
                            self._check_converged()
            except DataLossError as error:
                self.count("follower DataLossError")
                await self._told_loss(name, checker, error)
                self.resume_at[(name, stream)] = error.resume_sequence
                continue
            except Trimmed as error:
                self.count("follower Trimmed")
                self._told_trimmed(name, checker, error)
                continue
            except StreamEngineError as error:
                self.count(f"follower {type(error).__name__}")
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    async def _told_loss(self, name: str, checker: Checker, error: DataLossError) -> None:
        """Told the loss, a user goes on past it (invariant 1 holds it to what the
        master declared, once one serves)."""
        await wait_until(
            lambda: self.masters.state is not None or self.phase == "stopped",
            LIVENESS_MS / 1000,
            "a master serving",
            interval_s=WATCH_EVERY_MS / 1000,
        )
        self.check(self._loss_told, name, checker, error)

    def _told_trimmed(self, name: str, checker: Checker, error: Trimmed) -> None:
        told = (error.position, error.first_retained_sequence, self.masters.state)
        self.check(checker.trim_told, name, *told)

    def _many_followers(self) -> list[tuple[str, ManyFollower]]:
        return [(f"many{n}", many) for n, many in enumerate(self.config.many, 1)]

    def _followers_of(self, stream: str) -> list[str]:
        """The followers that read `stream`: every single one, and the followers of
        many whose selection covers it."""
        singles = [f"r{n}" for n in range(1, self.config.followers + 1)]
        return singles + [name for name, many in self._many_followers() if many.covers(stream)]

    async def _follower_of_many(self, name: str, many: ManyFollower) -> None:
        """Many streams through one `subscribe_many`, as a resuming application follows
        them: `positions` holds per stream the sequence after the last event handled;
        the subscription is dropped now and then in the safety phase (its drops drawn
        from a generator of its own) and opened again from `positions`."""
        positions: dict[str, int] = {}
        drops = random.Random(f"{self.config.seed}/{name}")
        while self.phase != "stopped":
            try:
                async with self.client() as client:
                    while self.phase != "stopped":
                        drop_s = drops.randint(1, many.drop_ms) / 1000
                        await self._subscribe_many(name, many, client, positions, drop_s)
            except StreamEngineError as error:  # no first contact: the master is away
                self.count(f"follower of many {type(error).__name__}")
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    async def _subscribe_many(
        self,
        name: str,
        many: ManyFollower,
        client: StreamClient,
        positions: dict[str, int],
        drop_s: float,
    ) -> None:
        """One subscription from `positions`, until it is dropped (`drop_s` later, in
        the safety phase) or raises; each event goes to its stream's checker, as a
        single follower's does. A loss or a trim it tells is handled as a single
        follower handles it, and the stream resumes past it."""
        names = tuple(s for s in many.names if s not in self.removed)
        if many.prefix is None and not names:
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)  # every stream it named is gone
            return
        subscription = client.subscribe_many(
            names or None, prefix=many.prefix, start=0, positions=positions
        )
        drop_at = self.loop.time() + drop_s if self.phase == "safety" else None
        try:
            async with contextlib.aclosing(subscription) as events, asyncio.timeout_at(drop_at):
                async for event in events:
                    positions[event.stream] = event.sequence + 1
                    checker = self.checkers.get(event.stream)
                    if checker is None:
                        continue  # created after a rebuild: nobody appends to it
                    self.check(checker.follower_event, name, event.sequence, event.payload)
                    if self.phase == "liveness":
                        self._check_converged()
            return
        except TimeoutError:
            self.count("subscriptions of many dropped")
            return
        except DataLossError as error:
            self.count("follower of many DataLossError")
            await self._told_loss(name, self.checkers[error.stream], error)
            positions[error.stream] = error.resume_sequence
            return
        except Trimmed as error:
            self.count("follower of many Trimmed")
            self._told_trimmed(name, self.checkers[error.stream], error)
            positions[error.stream] = error.first_retained_sequence
            return
        except StreamEngineError as error:
            self.count(f"follower of many {type(error).__name__}")
        await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    def _loss_told(self, name: str, checker: Checker, error: DataLossError) -> None:
        """`DataLossError`: only for a range an operator sealed accepting loss (every
        store syncs what it answers and keeps at least one replica of every sealed
        segment), and only where the master declared it (`Checker.loss_told`)."""
        if not error.accepted:
            raise Violation(1, f"follower {name}: told a loss no operator declared: {error}")
        state = self.masters.state
        if state is not None:
            self._losses_declared(checker, state)
        segment = SegmentKey(checker.stream_id, error.segment_epoch)
        loss = DataLoss(error.segment_epoch, error.first_index, error.last_index, True)
        checker.loss_told(name, segment, loss, through_end=True)

    # ---- the operator ----

    async def _ask_rolls(self) -> None:
        """Now and then `streamengine roll` of a random stream (`RequestRoll`): its
        leader rolls once it hears of it (invariant 17: `_rolls_heard`)."""
        rng = random.Random(f"{self.config.seed}/roll-asks/streams")
        while self.phase == "safety":
            await asyncio.sleep(rng.randint(*ROLL_ASK_EVERY_MS) / 1000)
            if self.phase != "safety":
                return
            stream = rng.choice(self.stream_names)
            request = master_pb2.RequestRollRequest(stream=stream)
            if not await self._operate(f"roll {stream}", request):
                continue
            state = self.masters.state
            lease = state.leases.get(stream) if state is not None else None
            if lease is not None and lease.holder and rng.random() < ROLL_ASK_ANSWERS_LOST_SHARE:
                # The renewal that names the stream may be the one whose answer is lost.
                node = lease.holder.partition("/")[0]
                self.network.lose_answers(node, LEASE_HEARTBEAT, ROLL_ASK_ANSWERS_LOST)
                self.note(f"{node}: its next {ROLL_ASK_ANSWERS_LOST} LeaseHeartbeat answers lost")

    async def _operator(self) -> None:
        """Now and then one of the CLI's calls: on a random stream `streamengine stream
        trim`, `update --retention-*`, `delete --yes` then `undelete`; or `drain` of a
        random store (`--cancel` a while later) or `rebalance`."""
        while self.phase == "safety":
            await asyncio.sleep(self.rng.randint(1, OPERATOR_EVERY_MS) / 1000)
            if self.phase != "safety":
                return
            stream = self.rng.choice(self.stream_names)
            roll = self.rng.random()
            if roll < 0.15:
                self.group.create_task(self._drain())
            elif roll < 0.25:
                await self._operate("rebalance", master_pb2.RebalanceRequest())
            elif roll < 0.5:
                acked = self.checkers[stream].acked_sequences
                if acked:
                    before = self.rng.choice(acked)
                    request = master_pb2.TrimStreamRequest(name=stream, before_sequence=before)
                    await self._operate(f"trim {stream} before {unpack_sequence(before)}", request)
            elif roll < 0.75:
                update = master_pb2.UpdateStreamRequest(name=stream)
                if self.rng.random() < 0.5:
                    update.retention_bytes = self.rng.choice((1, 2_000, 20_000))
                else:
                    update.retention_age_ms = self.rng.choice((500, 2_000, 5_000))
                retention = (
                    f"{update.retention_bytes} B"
                    if update.retention_bytes
                    else (f"{update.retention_age_ms} ms")
                )
                await self._operate(f"retention of {stream}: {retention}", update)
            else:
                self.group.create_task(self._delete_and_undelete(stream))

    async def _drain(self) -> None:
        store = self.rng.choice(sorted(self.stores))
        if not await self._operate(f"drain {store}", master_pb2.DrainStoreRequest(store_id=store)):
            return
        await asyncio.sleep(self.rng.randint(1, DRAINING_MS_MAX) / 1000)
        cancel = master_pb2.DrainStoreRequest(store_id=store, cancel=True)
        # Until it takes replicas again (through the liveness phase): stores drained
        # for good could leave too few for the streams' new segments.
        while self.phase != "stopped":
            if await self._operate(f"drain {store} --cancel", cancel, retried=True):
                return
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    async def _delete_and_undelete(self, stream: str) -> None:
        delete = master_pb2.DeleteStreamRequest(name=stream)
        codes: list[grpc.StatusCode] = []
        if not await self._operate(f"delete {stream}", delete, codes=codes):
            return
        in_doubt = bool(codes) and codes[0] in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        await asyncio.sleep(self.rng.randint(1, DELETED_MS_MAX) / 1000)
        undelete = master_pb2.UndeleteStreamRequest(name=stream)
        # Until it is back (through the liveness phase): a stream left deleted past its
        # grace is gone, and every acked event with it (the master unavailable until
        # then: seed 55), which the undelete's NOT_FOUND says.
        while self.phase != "stopped":
            codes.clear()
            if await self._operate(f"undelete {stream}", undelete, retried=True, codes=codes):
                break
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)
        if codes[-1:] == [grpc.StatusCode.NOT_FOUND]:
            self._removed_past_grace(stream)
            return
        # A delete answered UNAVAILABLE may still land later (its request handled
        # after all, after the undelete said there was nothing to undo: seed 86): the
        # operator looks again until the run ends, as one would after a call in doubt.
        describe = master_pb2.DescribeStreamRequest(name=stream)
        while in_doubt and self.phase != "stopped":
            await asyncio.sleep(OPERATOR_EVERY_MS / 1000)
            async with self.client() as client:
                try:
                    info = await client.master.DescribeStream(describe, timeout=OPERATOR_CALL_S)
                except grpc.aio.AioRpcError as error:
                    if error.code() == grpc.StatusCode.NOT_FOUND:
                        self._removed_past_grace(stream)
                        return
                    continue
                except StreamEngineError:
                    continue
            if info.deleted_until_ms:
                codes.clear()
                await self._operate(f"undelete {stream} (deleted after all)", undelete, codes=codes)
                if codes[-1:] == [grpc.StatusCode.NOT_FOUND]:
                    self._removed_past_grace(stream)
                    return

    def _removed_past_grace(self, stream: str) -> None:
        """The master removed `stream`: the operator could not undelete it within its
        grace. Its events are gone as asked; its marker and its followers' reads are no
        longer expected (`Checker.stream_removed`), every other stream's still are."""
        if stream in self.removed:
            return
        self.removed.add(stream)
        self.note(f"operator: {stream} is gone: its grace ran out before the undelete")
        self.count("streams removed past their grace")
        self.check(self.checkers[stream].stream_removed)
        self._check_converged()

    async def _operate(
        self,
        what: str,
        request: Any,
        retried: bool = False,
        codes: list[grpc.StatusCode] | None = None,
    ) -> bool:
        """One operator call to the masters, as the CLI makes it: whether it was done
        (`retried`: False only while it may be done on a later try); the status of a
        call that failed goes to `codes`."""
        method = type(request).__name__.removesuffix("Request")
        async with self.client() as client:
            try:
                reply = await getattr(client.master, method)(request, timeout=OPERATOR_CALL_S)
            except grpc.aio.AioRpcError as error:
                if codes is not None:
                    codes.append(error.code())
                self.note(f"operator: {what}: {error.code().name}")
                self.count(f"operator {method} {error.code().name}")
                retry = error.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.ABORTED,
                )
                return not (retried and retry)
            except StreamEngineError as error:  # no first contact: the master is away
                self.note(f"operator: {what}: {type(error).__name__}")
                return not retried
        trimmed = getattr(reply, "trimmed_epochs", None)
        self.note(f"operator: {what}" + (f": trimmed {list(trimmed)}" if trimmed else ""))
        self.count(f"operator {method}")
        return True

    # ---- the nemesis ----

    async def _nemesis(self) -> None:
        while self.phase != "stopped":
            await asyncio.sleep(self.rng.randint(1, self.config.chaos_every_ms) / 1000)
            if self.phase != "safety":
                return
            roll = self.rng.random()
            if roll < 0.25:
                self.group.create_task(self._crash_store(), context=node_context("nemesis"))
            elif roll < 0.45:
                self.group.create_task(self._crash_process(), context=node_context("nemesis"))
            elif roll < 0.55:
                self.group.create_task(self._fail_master(), context=node_context("nemesis"))
            elif roll < 0.75:
                self._partition()
            else:
                self._reset()

    def _down_ms(self, most: int) -> int:
        return self.rng.randint(self.config.lease_ms // 2, max(self.config.lease_ms, most))

    async def _crash_store(self) -> None:
        name = self.rng.choice(sorted(self.stores))
        if name not in self.nodes:
            return
        store = self.stores[name]
        wipe = self.config.wipes and self._may_wipe(name) and self.rng.random() < WIPE_CHANCE
        power_loss = self.rng.random() < 0.5
        matched = self._matched(store)
        served = self._served(store) if power_loss and not wipe else {}
        kept_identity = store.core is not None and bool(store.core.catalog.cluster_id())
        await self.stop(name)
        if wipe:
            self.wiped.add(name)
            if store.core is not None:
                held = self.held_before_wipe.setdefault(name, set())
                held.update(store.core.catalog.segments())
            store.wipe()
            self.note(f"{name} crashes; its disk is wiped")
            if self.config.registration_answers_lost:
                lost = self.config.registration_answers_lost
                self.network.lose_answers(name, REGISTER_STORE, lost)
                self.note(f"{name}: its next {lost} registration answers will be lost")
            for checker in self.checkers.values():
                self.check(checker.store_wiped, name)
        else:
            if power_loss:
                store.power_loss()
            self.note(f"{name} crashes{' with its power' if power_loss else ''}")
        lost = power_loss and not wipe and not store.fsync and kept_identity
        if lost and not store.kv.get(CLUSTER_ID_KEY):
            for checker in self.checkers.values():
                checker.identity_lost(name)
        self.count("store crashes")
        await asyncio.sleep(self._down_ms(self.config.store_down_ms_max) / 1000)
        if self.phase != "safety" or name in self.nodes:
            return
        self._restart_store(name, matched if power_loss and not wipe else {}, served)

    def _restart_store(
        self,
        name: str,
        matched: dict[SegmentKey, int],
        served: dict[str, dict[SegmentKey, frozenset[int]]] | None = None,
    ) -> None:
        store = self.stores[name]
        self.note(f"{name} restarts")
        self.start(name, store.serve())

        async def restarted() -> None:
            await store.serving.wait()
            assert store.core is not None
            core = store.core
            for stream, checker in self.checkers.items():
                self.check(
                    checker.store_restarted,
                    name,
                    core,
                    not store.fsync,
                    matched,
                    (served or {}).get(stream),
                )

        if matched:
            self.group.create_task(restarted())

    def _served(self, store: SimStore) -> dict[str, dict[SegmentKey, frozenset[int]]]:
        """Per stream, the copies `store` holds as they were served (`served_copies`):
        a store without fsync may lose some to older ones in its crash."""
        if store.core is None or store.fsync:
            return {}
        core = store.core
        by_stream: dict[int, list[SegmentKey]] = {}
        for segment in core.catalog.segments():
            by_stream.setdefault(segment.stream_id, []).append(segment)
        return {
            stream: checker.served_copies(core, by_stream.get(checker.stream_id, ()))
            for stream, checker in self.checkers.items()
        }

    @staticmethod
    def _matched(store: SimStore) -> dict[SegmentKey, int]:
        if store.core is None:
            return {}
        return {key: meta.matched_index for key, meta in store.core.catalog.metas().items()}

    def _may_wipe(self, name: str) -> bool:
        """At most min(N - W, W - 1) stores are ever wiped in a run, so every segment
        keeps the quorums its recovery needs."""
        policy = self.config.policy
        most = min(policy.replicas - policy.write_quorum, policy.write_quorum - 1)
        return name in self.wiped or len(self.wiped) < most

    async def _crash_process(self, process: Process | None = None) -> None:
        """`process` (else one drawn) crashes, and a new incarnation starts a while
        later."""
        if process is None:
            process = self.rng.choice(self.processes)
        node = process.node
        if node not in self.nodes:
            return
        self.note(f"{node} crashes")
        self.count("process crashes")
        # Cut off first: a dead process says nothing more (no release, no flush).
        for other in [*self.masters.names, *self.stores, *self._client_nodes()]:
            if other != node:
                self.network.cut(node, other)
        self.crashed.add(node)
        await self.stop(node)
        for checker in self.checkers.values():
            for writer_id in sorted(checker.open_appends):
                if writer_id.startswith(f"{node}/"):
                    checker.writer_gone(writer_id)
        await asyncio.sleep(self._down_ms(2 * self.config.lease_ms) / 1000)
        if self.phase != "safety":
            return
        process.incarnation += 1
        self.note(f"{process.node} starts")
        self.start(process.node, self._process(process))

    def _store_joined(self, name: str, core: SegmentStoreCore, lost: Sequence[SegmentKey]) -> None:
        self.count("store joins")
        if name in self.held_before_wipe:
            self.check(self._joined_knowing_its_losses, name, core)

    def _store_planned(
        self, name: str, commands: Sequence[Command], outcomes: Sequence[Outcome]
    ) -> None:
        """Invariant 3 as a store plans its commands: no write or seal it takes is below
        its segment's fence. The outcome says the fence: a write keeps it, a seal raises
        it to its own epoch, so either is above its epoch only if it was before."""
        for command, outcome in zip(commands, outcomes, strict=True):
            if isinstance(command, WriteCommand) and isinstance(outcome, WriteResult):
                epoch = command.writer_epoch
            elif isinstance(command, SealCommand) and isinstance(outcome, SealResult):
                epoch = command.new_epoch
            else:
                continue
            checker = self.checkers_by_id.get(command.segment.stream_id)
            if checker is not None:
                self.check(
                    checker.write_attempted, name, command.segment, epoch, outcome.fence, True
                )

    def _joined_knowing_its_losses(self, name: str, core: SegmentStoreCore) -> None:
        """Invariant 14 as a wiped store joins, however many of its registration
        answers were lost: the master keeps one incarnation of it, the one it runs, and
        every replica it held before its wipe that the master still places on it is
        marked lost there (or held again), so that it never answers for one."""
        state = self.masters.state
        if state is None:
            return
        record = state.stores.get(name)
        incarnation = core.catalog.incarnation()
        if record is None or record.incarnation != incarnation:
            known = record.incarnation if record is not None else None
            raise Violation(
                14, f"{name} joined as incarnation {incarnation}; the master has {known}"
            )
        for key in sorted(self.held_before_wipe[name]):
            segment = state.segments.get((key.stream_id, key.epoch))
            if segment is None or name not in segment.copy_set:
                continue
            if core.catalog.meta(key) is None and not core.catalog.is_lost(key):
                raise Violation(
                    14,
                    f"{name} joined as a new incarnation without segment {key.stream_id}/"
                    f"{key.epoch} marked lost, which it held before its wipe",
                )

    def _client_nodes(self) -> list[str]:
        followers = [f"r{n}" for n in range(1, self.config.followers + 1)]
        followers += [name for name, _ in self._many_followers()]
        return [p.node for p in self.processes] + followers

    async def _fail_master(self) -> None:
        embedded = self.masters.embedded
        if embedded is None:
            await self._fail_elected_master()
            return
        if embedded.name not in self.nodes:
            return
        self.note("the master restarts")
        self.count("master restarts")
        await self.stop(embedded.name)
        await asyncio.sleep(self._down_ms(self.config.lease_ms) / 1000)
        if self.phase != "safety" or embedded.name in self.nodes:
            return
        self.start(embedded.name, embedded.serve())

    async def _fail_elected_master(self) -> None:
        """The active master is killed (its lease left to expire), stopped cleanly, or
        cut off from etcd and the stores; now and then etcd itself goes down. Each comes
        back (or is healed) after a while."""
        etcd = self.masters.etcd
        assert etcd is not None
        active = self.masters.active()
        roll = self.rng.random()
        if roll < 0.1:
            if not etcd.running:
                return
            self.note("etcd crashes")
            self.count("etcd crashes")
            await etcd.crash()
            await asyncio.sleep(self._down_ms(self.config.lease_ms) / 1000)
            if self.phase == "safety" and not etcd.running:
                self.note("etcd restarts")
                etcd.restart()
            return
        if not active:
            return
        master = active[0]
        if roll < 0.4:
            self.note(f"{master.name} is cut off from etcd and the stores")
            self.count("masters cut off")
            for other in [etcd.name, *self.stores]:
                self.network.cut(master.name, other)
                heal_s = self.rng.randint(20, 4000) / 1000
                self.loop.call_later(heal_s, self._heal, master.name, other)
            return
        clean = roll < 0.6
        self.note(f"{master.name} {'stops' if clean else 'crashes'}")
        self.count("master stops" if clean else "master crashes")
        await (master.stop() if clean else master.crash())
        await asyncio.sleep(self._down_ms(2 * self.config.lease_ms) / 1000)
        if self.phase == "safety" and not master.running:
            self.note(f"{master.name} restarts")
            master.restart()

    def _servers(self) -> list[str]:
        return [*self.masters.names, *sorted(self.stores)]

    def _partition(self) -> None:
        a, b = self.rng.sample(self._servers() + self._client_nodes(), 2)
        if self.network.partitioned(a, b):
            return
        self.note(f"partition {a} | {b}")
        self.count("partitions")
        self.network.cut(a, b)
        heal_s = self.rng.randint(20, 3 * self.config.lease_ms) / 1000
        self.loop.call_later(heal_s, self._heal, a, b)

    def _heal(self, a: str, b: str) -> None:
        if self.network.partitioned(a, b) and self.phase == "safety":
            self.note(f"heal {a} | {b}")
            self.network.cuts.discard((min(a, b), max(a, b)))
            clients = self._client_nodes()
            for client, server in ((a, b), (b, a)):
                waiting = self.network.unanswered_dials.get((client, server))
                if client in clients and waiting:
                    healed_at = self.loop.time()
                    self._healed_dials.append((healed_at, client, server, frozenset(waiting)))

    def _reset(self) -> None:
        a, b = self.rng.sample(self._servers() + self._client_nodes(), 2)
        self.note(f"reset {a} | {b}")
        self.network.reset(a, b)

    # ---- replicas destroyed for good, and `seal --accept-loss` ----

    async def _destroy_replicas(self) -> None:
        """At `destroy_at_ms`, replicas of one segment destroyed for good (see
        `ACCEPT_LOSS_SHARE`); where that left fewer than R of an unsealed segment, the
        operator stops the processes leading its stream and seals it accepting loss."""
        await asyncio.sleep(self.config.loss_at_ms / 1000)
        state = self.masters.state
        while state is None and self.phase == "safety":  # no master serves
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)
            state = self.masters.state
        if state is None or self.phase != "safety":
            return
        stream = self.rng.choice([s for s in self.stream_names if s not in self.removed])
        segments = state.stream_segments(self.checkers[stream].stream_id)
        sealed = [s for s in segments if s.final_index and not s.removal_at_ms]
        unsealed = [s for s in segments if not s.final_index]
        if sealed and (not unsealed or self.rng.random() < DESTROY_SEALED_CHANCE):
            segment = sealed[-1]
        elif unsealed:
            segment = unsealed[-1]
        else:
            return
        key = SegmentKey(segment.stream_id, segment.epoch)
        keeper = self._survivor(key, segment.final_index, segment.copy_set)
        if keeper is None:
            return
        for name in segment.copy_set:
            if name != keeper:
                await self._destroy(name, key)
        self.count("replicas destroyed", len(segment.copy_set) - 1)
        if segment.final_index:
            self.note(f"{stream} segment {segment.epoch} (sealed) left on {keeper} alone")
            return
        self.note(f"{stream} segment {segment.epoch} left on {keeper} alone: the stream is stuck")
        self.held_off[stream] = asyncio.Event()
        for process in self.processes:
            if stream in process.streams and process.node in self.nodes:
                crash = self._crash_process(process)
                self.group.create_task(crash, context=node_context("nemesis"))
        self.start("sealer", self._seal_accepting_loss(stream, key, keeper))

    def _survivor(self, key: SegmentKey, final: int, copy_set: Sequence[str]) -> str | None:
        """The replica left of `key`: of a sealed segment, one holding its bridge; of an
        unsealed one the least advanced (`DESTROY_AHEAD_CHANCE`) or one drawn. Never a
        rotted one: the segment would be lost beyond what the run destroyed (seed 2550:
        store0's rotted replica of 2/1 was left alone, and nothing could refill it)."""
        held = {}
        for name in copy_set:
            if (name, key) in self.rotten:
                continue
            core = self.stores[name].core
            meta = core.catalog.meta(key) if core is not None else None
            if meta is not None and (not final or meta.acked_index >= final):
                held[name] = meta.matched_index
        if not held:
            return None
        if not final and self.rng.random() < DESTROY_AHEAD_CHANCE:
            return min(sorted(held), key=lambda name: held[name])
        return self.rng.choice(sorted(held))

    async def _destroy(self, name: str, key: SegmentKey) -> None:
        """`name`'s replica of `key` destroyed for good: the store's process dies, its
        replica is deleted and marked lost (as a wiped store's new incarnation marks
        what it held: the store never stands for it again), and it starts again."""
        store = self.stores[name]
        running = name in self.nodes
        if running:
            await self.stop(name)
        core = SegmentStoreCore(store.kv, joins_cluster=True)
        cluster_id = core.catalog.cluster_id()
        assert cluster_id, f"{name} destroyed before it joined"
        core.apply(core.plan([DeleteCommand(key), JoinCommand(cluster_id, (key,))]))
        for checker in self.checkers.values():
            self.check(checker.store_deleted, name, key)
        self.note(f"{name}: its replica of {key.stream_id}/{key.epoch} is destroyed")
        if running:
            self._restart_store(name, {})

    async def _seal_accepting_loss(self, stream: str, key: SegmentKey, survivor: str) -> None:
        """The operator's `streamengine seal STREAM --accept-loss --yes`, run again until
        it is done (each run makes the CLI's calls, `ops.cmd_seal`); a run is now and
        then interrupted once the survivor holds a bridge the master has not recorded.
        Then the stream's processes lead it again."""
        while self.phase != "stopped":
            seal = asyncio.create_task(self._seal_once(stream))
            try:
                if self.rng.random() < SEAL_INTERRUPT_CHANCE:
                    await self._interrupt_at_bridge(seal, key, survivor)
                await asyncio.wait([seal])
            finally:
                seal.cancel()  # the sealer stopped with the world: its run goes too
            if not seal.cancelled() and seal.result():
                break
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)
        self.held_off[stream].set()

    async def _seal_once(self, stream: str) -> bool:
        """One run of `streamengine seal STREAM --accept-loss --yes`: whether it sealed."""
        try:
            async with self.client() as client:
                await client.describe_stream(stream)
                epoch = await client.seal(stream, timeout_s=SEAL_TIMEOUT_S, accept_loss=True)
                segments = await client.list_segments(stream)
        except (StreamEngineError, grpc.aio.AioRpcError) as error:
            name = type(error).__name__
            self.note(f"operator: seal {stream} --accept-loss: {name}: {error}")
            self.count(f"operator seal --accept-loss {name}")
            return False
        lost = [f"{s.epoch} from {s.lost_from_index}" for s in segments if s.lost_from_index]
        self.note(f"operator: sealed {stream} through {epoch} accepting loss; lost: {lost}")
        self.count("operator seals accepting loss")
        if lost:
            self.count("seals declaring loss")
        return True

    async def _interrupt_at_bridge(
        self, seal: asyncio.Task[bool], key: SegmentKey, survivor: str
    ) -> None:
        """Cancel `seal` (the operator's Ctrl-C) once `survivor` holds a bridge of `key`
        the master has not recorded sealed."""
        while not seal.done():
            await asyncio.sleep(SEAL_WATCH_MS / 1000)
            state = self.masters.state
            record = state.segments.get((key.stream_id, key.epoch)) if state else None
            if record is None or record.final_index:
                continue
            core = self.stores[survivor].core
            meta = core.catalog.meta(key) if core is not None else None
            if meta is None or not meta.last_index:
                continue
            last = core.reader.read(key, meta.last_index, meta.last_index) if core else []
            if last and last[0].kind == EntryKind.BRIDGE:
                seal.cancel()
                self.note(f"operator: seal interrupted, {survivor} bridged at {meta.last_index}")
                self.count("seals accepting loss interrupted")
                return

    # ---- the master's metadata lost and rebuilt ----

    async def _lose_metadata(self) -> None:
        """At `loss_at_ms` the master's disk is lost; the operator starts it with
        `streamengine master --rebuild` (`SimMaster.lose_metadata`)."""
        await asyncio.sleep(self.config.loss_at_ms / 1000)
        master = self.masters.embedded
        if self.phase != "safety" or master is None:
            return
        if master.name in self.nodes:
            await self.stop(master.name)
        master.lose_metadata()
        self.note("the master's metadata is lost: it starts again with --rebuild")
        self.count("master metadata lost")
        if master.name not in self.nodes:  # else a restart of the nemesis's came first
            self.start(master.name, master.serve())

    def _rebuilt(self, state: MasterState) -> None:
        """The master serves the metadata it rebuilt from the stores: every stream it
        rebuilt keeps its id (a stream created and never written may be gone: `master
        --rebuild` knows only what the stores were told); the operator creates a
        stream, whose id must be new."""
        self.count("metadata rebuilt")
        # Replicas of stores whose disks are newer than the records naming them.
        self.count("replicas a rebuild found lost", sum(len(r.lost) for r in state.stores.values()))
        self.note(f"the master rebuilt {len(state.streams)} streams from the stores")
        self.masters.checker.rebuilt(self._epochs_stores_saw())
        for stream, checker in sorted(self.checkers.items()):
            record = state.streams.get(stream)
            if record is not None and record.stream_id != checker.stream_id:
                self.check(
                    self._raise,
                    Violation(
                        5,
                        f"{stream} rebuilt as stream id {record.stream_id}; it was "
                        f"{checker.stream_id}",
                    ),
                )
        name = f"t0/rebuilt{len(self.created_after_rebuild)}"
        self.created_after_rebuild.append(name)
        held, through = self._stream_ids_stores_held()
        for stream, checker in sorted(self.checkers.items()):
            if checker.stream_id not in held and checker.stream_id > through:
                self._lost_with_the_metadata(stream)
        self._check_converged()
        self.group.create_task(
            self._create_after_rebuild(name, max([through, *held])),
            context=node_context("setup"),
        )

    def _epochs_stores_saw(self) -> dict[str, int]:
        """Per stream, the highest epoch any store holds of it (a segment's or a
        fence), down or up."""
        names = {checker.stream_id: stream for stream, checker in self.checkers.items()}
        used: dict[str, int] = {}
        for _, store in sorted(self.stores.items()):
            for key, meta in SegmentStoreCore(store.kv).catalog.metas().items():
                stream = names.get(key.stream_id)
                if stream is not None:
                    used[stream] = max(used.get(stream, 0), key.epoch, meta.fence)
        return used

    def _stream_ids_stores_held(self) -> tuple[set[int], int]:
        """What the stores, down or up, know of the stream ids the lost master gave:
        the ids they hold a segment of or keep a card of, and the highest id their
        cluster views say was given. A rebuild can know no more."""
        held: set[int] = set()
        through = 0
        for _, store in sorted(self.stores.items()):
            catalog = SegmentStoreCore(store.kv).catalog
            held.update(key.stream_id for key in catalog.metas())
            raw = catalog.cluster_view()
            if raw:
                view = entry_pb2.ClusterView.FromString(raw)
                held.update(card.stream_id for card in view.streams)
                through = max(through, view.stream_ids_through)
        return held, through

    def _lost_with_the_metadata(self, stream: str) -> None:
        """No store ever heard of `stream` (created and never written, given after
        every view a store keeps): it is lost with the metadata, the never-written
        stream of docs/design.md's Known gaps. Its writers are told NotFound for good;
        its marker and its followers' reads are no longer expected."""
        checker = self.checkers[stream]
        if checker.acked_sequences and not checker.unsynced_losses:
            self.check(
                self._raise,
                Violation(
                    1,
                    f"{stream}: {len(checker.acked_sequences)} events acked, yet no store "
                    "holds a segment of it",
                ),
            )
        self.removed.add(stream)
        self.note(f"{stream} is lost with the metadata: no store ever heard of it")
        self.count("streams lost with the metadata, never written")
        self.check(checker.stream_removed)

    async def _create_after_rebuild(self, name: str, held: int) -> None:
        """`streamengine stream create NAME`, until answered: its id is above every id
        the stores knew was given when the metadata was rebuilt (`held`)."""
        policy = self.config.policy
        while self.phase != "stopped":
            try:
                async with self.client() as client:
                    info = await client.create_stream(
                        name, replicas=policy.replicas, write_quorum=policy.write_quorum
                    )
            except StreamEngineError as error:
                self.note(f"operator: create {name}: {type(error).__name__}")
                await asyncio.sleep(LEAD_AGAIN_MS / 1000)
                continue
            self.note(f"operator: created {name}: stream id {info.stream_id}")
            self.count("streams created after a rebuild")
            if info.stream_id <= held:
                self.check(
                    self._raise,
                    Violation(
                        5,
                        f"{name} created as stream id {info.stream_id}; the stores held "
                        f"ids up to {held}",
                    ),
                )
            return

    # ---- checks while running ----

    async def _watch(self) -> None:
        """Invariant 7 every `WATCH_EVERY_MS`: no append open past the writer's append
        timeout; and every `AUDIT_EVERY_MS` an audit of every store."""
        audit_at = self.now_ms + AUDIT_EVERY_MS
        while self.phase != "stopped":
            await asyncio.sleep(WATCH_EVERY_MS / 1000)
            now = self.now_ms
            self.check(self.masters.look)
            self.check(self._rolls_heard)
            self.check(self._healed_cuts_crossed)
            self.check(self._closes_ended)
            for checker in self.checkers.values():
                for writer_id in sorted(checker.open_appends):
                    if writer_id.partition("/")[0] in self.crashed:
                        continue
                    late_ms = now - APPEND_END_SLACK_MS
                    if not self.check(checker.writer_running, writer_id, late_ms):
                        self._describe(writer_id)
            if now >= audit_at:
                audit_at = now + AUDIT_EVERY_MS
                self._audit_all()
                if self.rotten:
                    self._follow_repairs()

    def _rolls_heard(self) -> None:
        """A leader bound to its process's lease session hears of a roll its master
        owes it (a store of its copy set dead, drained or wiped, an operator's ask):
        once the session's renewals were answered `ROLL_HEARD_LEASES` leases (and a
        slow message) past the first time the master had the roll, the leader has sent
        its own heartbeat since (whose answer says why it should roll), or heard of
        the roll otherwise. A renewal names such a stream (its `attention`) for the
        leader to ask."""
        state = self.masters.state
        if state is None or state is not self._owed_rolls_of:
            self._owed_rolls_of = state
            self._owed_rolls_since.clear()
            return
        now_ms = monotonic_ms()
        owed = state.leadership.owed_rolls(wall_ms())
        for key in [k for k in self._owed_rolls_since if owed.get(k[0], (0,))[0] != k[1]]:
            del self._owed_rolls_since[key]
        bound_ms = ROLL_HEARD_LEASES * self.config.lease_ms + self.config.faults.slow_delay_ms_max
        for stream, (epoch, reason) in sorted(owed.items()):
            since_ms = self._owed_rolls_since.setdefault((stream, epoch), now_ms)
            lease = state.leases[stream]
            writer = self.writers.get(lease.holder)
            if writer is None or lease.holder.partition("/")[0] in self.crashed:
                continue
            core = writer._core
            session = core._renewing_session()
            if (
                session is None
                or core.role is not writer_core.Role.LEADING
                or core.epoch != epoch
                or core.heartbeat_sent_ms >= since_ms
                or core._roll_requested
                or core._rolling
                or session.renewal_answered_at_ms - since_ms <= bound_ms
            ):
                continue
            raise Violation(
                17,
                f"{lease.holder} leads epoch {epoch} of {stream}, owed a roll ({reason}) "
                f"for {now_ms - since_ms} ms; its session's renewals were answered until "
                f"{now_ms - session.renewal_answered_at_ms} ms ago, and it never asked",
            )

    def _healed_cuts_crossed(self) -> None:
        """A client whose dial waited on a cut when it healed sends a fresh SYN within
        `DIAL_HEDGE_MS` (and a tick), unless that dial ended meanwhile: the kernel's
        next retransmission may be a second or more away, and a writer that waits for
        it has a copy set short of a store it could reach (S7)."""
        now = self.loop.time()
        due = [d for d in self._healed_dials if now >= d[0] + HEALED_CUT_CROSSED_S]
        self._healed_dials = [d for d in self._healed_dials if d not in due]
        for healed_at, client, server, dials in due:
            if (
                client in self.crashed
                or self.network.partitioned(client, server)
                or all(dial.done() for dial in dials)
                or self.network.syns_sent.get((client, server), -1.0) >= healed_at
            ):
                continue
            raise Violation(
                18,
                f"{client}'s dial to {server} still waits {round((now - healed_at) * 1000)} "
                f"ms after their cut healed, and no SYN went since",
            )

    def _closes_ended(self) -> None:
        """Closing a connection holds its holder a moment at most, even one whose peer
        takes nothing: a writer's Write stream found unanswered waited out TCP's user
        timeout for its buffer to go, neither dialling again nor serving the segments
        it carries (S7 in the clean-clone run: 5 s, and a second store's fault
        meanwhile held appends 1 s)."""
        now = self.loop.time()
        for (node, peer, began), ended in self.network.close_waits.items():
            waited = (now if ended is None else ended) - began
            if waited > CLOSE_WAIT_S_MAX:
                raise Violation(
                    19,
                    f"{node}'s close of its connection to {peer} waited "
                    f"{round(waited * 1000)} ms for a buffer the silent peer never takes",
                )

    def _describe(self, writer_id: str) -> None:
        writer = self.writers.get(writer_id)
        if writer is not None:
            stats = writer.statistics()
            self.note(
                f"{writer_id}: {stats.role} epoch {stats.epoch}, last index "
                f"{stats.last_index}, acked {stats.acked_index}, "
                f"{stats.pending_appends} pending, {stats.waiting_appends} waiting, "
                f"unsealed {list(stats.unsealed_epochs)}, "
                f"{'a segment' if writer._core.replicator else 'NO SEGMENT'}"
            )

    def _audit_all(self) -> None:
        """Every stream's checker audits the stores serving, each against what they
        hold of its own stream (sorted by stream once for all)."""
        state = self.masters.state
        if state is None:
            return  # no master serves: the next audit looks
        cores = {
            name: store.core
            for name, store in sorted(self.stores.items())
            if store.core is not None and store.serving.is_set()
        }
        held: dict[int, dict[str, set[SegmentKey]]] = {}
        for name, core in cores.items():
            for key in core.catalog.segments():
                held.setdefault(key.stream_id, {}).setdefault(name, set()).add(key)
        for checker in self.checkers.values():
            self.check(self._audit, checker, state, cores, held.get(checker.stream_id, {}))

    @staticmethod
    def _losses_declared(checker: Checker, state: MasterState) -> None:
        """The master's declared losses (segments sealed accepting loss), to `checker`."""
        for segment in state.stream_segments(checker.stream_id):
            if segment.lost_from_index:
                key = SegmentKey(checker.stream_id, segment.epoch)
                checker.loss_declared(key, segment.lost_from_index)

    @classmethod
    def _audit(
        cls,
        checker: Checker,
        state: MasterState,
        cores: dict[str, SegmentStoreCore],
        held: dict[str, set[SegmentKey]],
    ) -> None:
        cls._losses_declared(checker, state)
        for segment in state.stream_segments(checker.stream_id):
            if segment.final_index:
                key = SegmentKey(checker.stream_id, segment.epoch)
                checker.sealed_at_master(key, segment.final_index, cores)
                if segment.certificate is not None and cls._certified(checker):
                    checker.certificate_recorded(key, segment.certificate, cores)
        checker.audit(cores, state, held)

    # ---- bit rot at rest ----

    async def _intrude(self) -> None:
        """Bad input through the front doors, from a generator of its own (the
        `INTRUDER_SHARE` comment)."""
        rng = random.Random(f"{self.config.seed}/intruder")
        transport = self.admin_transport()
        async with self.client() as client:
            while self.phase == "safety":
                await asyncio.sleep(rng.randint(*INTRUDER_EVERY_MS) / 1000)
                if self.phase != "safety":
                    return
                case = rng.randrange(4)
                if case == 0:
                    kind = "a write below a fence"
                    tried = await self._write_below_a_fence(rng, transport)
                elif case in (1, 2):
                    method = badinput.DATA_WRITE if case == 1 else badinput.DATA_READ
                    kind = f"garbage as a {method.name}"
                    tried = await self._garbage(rng, transport, method)
                else:
                    kind = "a stream without a tenant"
                    tried = await self._bad_stream(client)
                if tried:
                    self.count(f"bad input refused: {kind}")

    async def _call_standbys(self) -> None:
        """Every few hundred ms, one call of the master's service to a master standing
        by: it answers UNAVAILABLE (naming the active master), or refuses the request
        as it is (an empty one is malformed for most calls); never UNKNOWN or INTERNAL
        (an assertion in a servicer: SealSegment's before 36b321b), and never OK unless
        it was the active master when the call began or ended."""
        rng = random.Random(f"{self.config.seed}/standby-calls/calls")
        templates = badinput.fuzz_templates()
        methods = [
            method
            for method in master_pb2.DESCRIPTOR.services_by_name["Master"].methods
            if method.name not in STANDBY_CALLS_LEFT_OUT
        ]
        transport = self.admin_transport()
        while self.phase == "safety":
            await asyncio.sleep(rng.randint(*INTRUDER_EVERY_MS) / 1000)
            now = wall_ms()
            standbys = [m for m in self.masters.elected if m.running and not m.active(now)]
            if self.phase != "safety" or not standbys:
                continue
            master = rng.choice(standbys)
            method = rng.choice(methods)
            template = templates.get(method.name)
            if template is None or rng.random() < 0.5:
                request = badinput.request_class(method)()
            else:
                request = template
            path = f"/{method.containing_service.full_name}/{method.name}"
            async with transport.aio_channel(master.address) as typed:
                # Untyped: grpc's stubs type a multicallable without serializers as
                # taking nothing.
                channel: Any = typed
                try:
                    if method.server_streaming:
                        call = channel.unary_stream(path)(
                            request.SerializeToString(), timeout=STANDBY_CALL_S
                        )
                        async for _ in call:
                            break
                        call.cancel()
                    else:
                        await channel.unary_unary(path)(
                            request.SerializeToString(), timeout=STANDBY_CALL_S
                        )
                    code, details = "OK", ""
                except grpc.aio.AioRpcError as error:
                    code, details = error.code().name, error.details() or ""
            became_active = master.active(wall_ms())
            self.count(f"standby calls answered {code}")
            self.note(f"standby-caller: {method.name} at {master.name}: {code}")
            what = f"{method.name} at standby {master.name}: {code} {details[:120]!r}"
            self.check(_answered_as_a_standby, what, code, became_active)

    async def _write_below_a_fence(self, rng: random.Random, transport: Transport) -> bool:
        """A write one epoch below a sealed replica's fence, past its bridge, with no
        grant: refused as not granted before anything else is looked at."""
        sealed = []
        for name, store in sorted(self.stores.items()):
            if store.core is None or not store.serving.is_set():
                continue
            for key, final in sorted(store.core.catalog.scrub_targets().items()):
                meta = store.core.catalog.meta(key)
                if meta is not None and meta.fence >= 2:
                    sealed.append((name, key, final, meta.fence))
        if not sealed:
            return False
        name, key, final, fence = rng.choice(sealed)
        entries = [StoredEntry.make(final + 1, EntryKind.EVENT, fence - 1, b"intruder")]
        segment = entry_pb2.SegmentId(stream_id=key.stream_id, epoch=key.epoch)
        request = codec.write_request(entries, segment=segment, writer_epoch=fence - 1)
        what = f"a write at epoch {fence - 1} below the fence {fence} of {name}'s {key}"
        got = await badinput.data_exchange(
            transport,
            self.stores[name].data_address,
            badinput.DATA_WRITE,
            badinput.serialized(request),
        )
        return self._refused(what, got, ("PERMISSION_DENIED",))

    async def _garbage(
        self, rng: random.Random, transport: Transport, method: badinput.DataMethod
    ) -> bool:
        """Bytes that parse as no request of `method`: INVALID_ARGUMENT, exactly."""
        name = rng.choice(sorted(self.stores))
        data = badinput.random_bytes(rng, method)
        address = self.stores[name].data_address
        got = await badinput.data_exchange(transport, address, method, [data])
        what = f"{len(data)} bytes of garbage as a {method.name}"
        return self._refused(what, got, ("INVALID_ARGUMENT",))

    async def _bad_stream(self, client: StreamClient) -> bool:
        """A stream whose name has no tenant: INVALID_ARGUMENT at the master."""
        request = master_pb2.CreateStreamRequest(
            name="no-tenant",
            policy=entry_pb2.ReplicationPolicy(replicas=1, write_quorum=1),
            create_tenant=True,
        )
        try:
            await client.master.CreateStream(request, timeout=OPERATOR_CALL_S)
            got = ("OK", "")
        except grpc.aio.AioRpcError as error:
            got = (error.code().name, error.details() or "")
        return self._refused("a stream named without a tenant", got, ("INVALID_ARGUMENT",))

    def _refused(self, what: str, got: tuple[str, str], expected: tuple[str, ...]) -> bool:
        """Whether the call got through (False: cut by faults or a server down);
        invariant 6 is broken unless it was refused as `expected`."""
        code, details = got
        if code in NOT_THROUGH:
            return False

        def refused() -> None:
            if code not in expected:
                wanted = " or ".join(expected)
                raise Violation(6, f"{what}: {code} {details!r}, expected {wanted}")

        self.check(refused)
        return True

    async def _rot(self) -> None:
        """Now and then a stored event of one replica of a sealed segment rots, behind
        its store's back: a byte flips, so its crc32c no longer holds; or, where the
        master holds the segment's certificate, the copy is forged (`FORGE_SHARE`): its
        payload changed under a crc32c computed again, which only the certificate
        tells. Only where the segment keeps W sound replicas besides, on stores
        serving."""
        while self.phase == "safety":
            await asyncio.sleep(self.rng.randint(1, 2 * ROT_EVERY_MS) / 1000)
            if self.phase != "safety":
                return
            chances = self._rot_chances()
            if not chances:
                continue
            name, key, final = self.rng.choice(chances)
            store = self.stores[name]
            assert store.core is not None
            # Read past a copy rotted already (runtime seed 416: the verifying reader
            # raised on it, ending the run with a world error).
            copies = sound_copies(store.core, key, final)
            events = [i for i, (kind, _) in sorted(copies.items()) if kind == EntryKind.EVENT]
            if not events:
                continue
            victim = self.rng.choice(events)
            entry = entry_key(key.stream_id, key.epoch, victim)
            value = store.kv.get(entry)
            assert value is not None
            # Drawn whether the bit flips or the copy is forged: the world's draws stay
            # where they were.
            at = self.rng.randrange(VALUE_HEADER_BYTES, len(value))
            bit = self.rng.randrange(8)
            forge = self.forge_draws.random() < FORGE_SHARE and self.config.forges
            forge = forge and self._certificate(key, final) is not None
            if forge:
                copy = decode_value(victim, value)
                forged = StoredEntry.make(victim, copy.kind, copy.epoch, b"forged:" + copy.payload)
                rotted = encode_value(forged.kind, forged.epoch, forged.crc32c, forged.payload)
                self.forged.add((name, key))
                self.count("copies forged")
            else:
                rotted = value[:at] + bytes([value[at] ^ 1 << bit]) + value[at + 1 :]
            store.kv.write([Put(entry, rotted)], sync=True)
            self.checkers_by_id[key.stream_id].rotted.add((name, key))
            self.rotten[(name, key)] = self.now_ms
            self.count("replicas rotted")
            self.note(
                f"rot: {name} segment {key.stream_id}/{key.epoch} index {victim}"
                + (" forged under a valid crc32c" if forge else "")
            )

    def _certificate(self, key: SegmentKey, final: int) -> Certificate | None:
        """The serving master's certificate of `key`, sealed at `final`, if it has one."""
        state = self.masters.state
        segment = None if state is None else state.segments.get((key.stream_id, key.epoch))
        if segment is None or segment.final_index != final or segment.certificate is None:
            return None
        return segment.certificate if segment.certificate.final_index == final else None

    def _rot_chances(self) -> list[tuple[str, SegmentKey, int]]:
        state = self.masters.state
        if state is None:
            return []
        quorum = self.config.policy.write_quorum
        chances = []
        for name, store in sorted(self.stores.items()):
            if store.core is None or not store.serving.is_set():
                continue
            for key, final in sorted(store.core.catalog.scrub_targets().items()):
                segment = state.segments.get((key.stream_id, key.epoch))
                if (
                    key.stream_id not in self.checkers_by_id
                    or segment is None
                    or segment.final_index != final
                    or any(key == rotted for _, rotted in self.rotten)
                ):
                    continue
                others = [other for other in segment.copy_set if other != name]
                if len(self._sound_replicas(key, final, others)) >= quorum:
                    chances.append((name, key, final))
        return chances

    def _sound_replicas(self, key: SegmentKey, final: int, names: Sequence[str]) -> list[str]:
        """Those of `names` serving a replica of `key` complete to its bridge at
        `final`, each copy's crc holding, that the store does not count damaged, and
        that holds the master's certificate of the segment when it has one (a forged
        copy passes its crc32c). Read as stored: a read through the store's reader
        would mark what it finds damaged, doing the scrub's work for it (its certificate
        is read once every crc held, which marks nothing)."""
        certificate = self._certificate(key, final)
        sound = []
        for name in names:
            store = self.stores.get(name)
            core = store.core if store is not None else None
            if store is None or core is None or not store.serving.is_set():
                continue
            meta = core.catalog.meta(key)
            if meta is None or meta.acked_index < final or key in core.catalog.damaged():
                continue
            rows = core.reader.read_rows(key, 1, final)
            try:
                for row, value in rows:
                    decode_value(entry_index(row), value)
            except CorruptEntry:
                continue
            if len(rows) != final:
                continue
            if certificate is None or core.reader.certify(key, final).certificate == certificate:
                sound.append(name)
        return sound

    def _follow_repairs(self) -> None:
        """Rotted replicas the scrub found (their store counts them damaged; a forged
        one, which the store cannot tell, the master condemns: `_condemned`), and those
        sound again (the audits check them again), or no longer wanted (the segment
        trimmed or deleted, or moved off their store)."""
        state = self.masters.state
        if state is None:
            return
        for (name, key), rotted_at in sorted(self.rotten.items()):
            core = self.stores[name].core
            if core is not None and key in core.catalog.damaged():
                segment_id = f"{key.stream_id}/{key.epoch}"
                self._rot_found(name, key, f"{name} found segment {segment_id} damaged")
            segment = state.segments.get((key.stream_id, key.epoch))
            gone = segment is None or name not in segment.copy_set
            if segment is None or gone or self._sound_replicas(key, segment.final_index, [name]):
                del self.rotten[(name, key)]
                if not gone:  # else it stays unaudited until its store drops it
                    self.checkers_by_id[key.stream_id].rotted.discard((name, key))
                outcome = "dropped" if gone else "repaired"
                self.count(f"rotted replicas {outcome}")
                if (name, key) in self.forged:
                    self.forged.discard((name, key))
                    self.count(f"forged replicas {outcome}")
                self.note(
                    f"{name} segment {key.stream_id}/{key.epoch} "
                    f"{'no longer wanted' if gone else 'sound again'} after "
                    f"{self.now_ms - rotted_at} ms"
                )

    def _grant_issued(self, grant: Grant) -> None:
        checker = self.checkers_by_id.get(grant.stream_id)
        if checker is not None:
            checker.grant_issued(grant)

    def _grant_taken(self, store: str, segment: SegmentKey, epoch: int) -> None:
        """Invariant 11 as a store takes a grant: a master issued one of that epoch
        listing the segment with the store in its copy set (`_observing_grants`)."""
        checker = self.checkers_by_id.get(segment.stream_id)
        if checker is not None:
            self.check(checker.change_granted, store, segment, epoch)
            self.count("grants taken checked")

    def _condemned(self, state: MasterState, key: tuple[int, int], stores: Sequence[str]) -> None:
        """The master condemned `stores`' replicas of `key` (`_observing_condemnations`):
        each must differ from the segment's certificate (invariant 12), as a forged or
        rotted one does."""
        checker = self.checkers_by_id.get(key[0])
        segment = state.segments.get(key)
        if checker is None or segment is None or segment.certificate is None:
            return
        replica = SegmentKey(*key)
        for name in stores:
            self.count("replicas condemned")
            if (name, replica) in self.forged:
                self.count("forged replicas condemned")
            if (name, replica) in self.rotten:
                # Found by its store's scrub, whose report the master judged.
                condemned = f"the master condemned {name}'s segment {key[0]}/{key[1]}"
                self._rot_found(name, replica, condemned)
            store = self.stores.get(name)
            serving = store is not None and store.serving.is_set()
            core = store.core if store is not None and serving else None
            if self._certified(checker):
                self.check(checker.replica_condemned, name, core, replica, segment.certificate)

    def _reader_reported(
        self, reader: str, stream: str, epoch: int, address: str, problem: str
    ) -> None:
        """A reader reports the replica at `address` of `stream`'s segment `epoch` to the
        master (`_observing_reports`): only a rotted or forged one may differ from what
        its reader checks it against (invariant 12)."""
        checker = self.checkers.get(stream)
        name = next(
            (n for n, s in self.stores.items() if address in (s.address, s.data_address)), None
        )
        if checker is None or name is None:
            return
        self.count("replicas readers reported")
        replica = SegmentKey(checker.stream_id, epoch)
        if self._certified(checker):
            self.check(checker.reader_reported, reader, name, replica, problem)

    @staticmethod
    def _certified(checker: Checker) -> bool:
        """Whether `checker`'s stream is held to its certificates (invariant 12): not
        once a store with fsync never lost acked entries of it, after which what its
        replicas hold may differ from what its writer certified (a recovery deciding
        from what that store kept), the documented loss, which the run's outcome counts
        only for the invariants of `LOSS_CAN_BREAK`."""
        return not checker.unsynced_losses

    def _rot_found(self, name: str, key: SegmentKey, note: str) -> None:
        if (name, key) not in self.rot_found:
            self.rot_found.add((name, key))
            self.count("rotted replicas found by the scrub")
            self.note(note)

    async def _wait_for_repairs(self) -> None:
        """Invariant 10 once faults stopped: every rotted replica sound again, and each
        of its segments with N sound replicas, within `REPAIRED_MS_MAX`. A segment on
        exactly N stores that lost other replicas too (a wiped store, one that never
        synced) is refilled member after member, each after the bridge grace its
        previous swap restarted: the window covers them all."""
        with contextlib.suppress(TimeoutError):
            await wait_until(
                lambda: not self.rotten and self._rotted_short_of_n() is None,
                REPAIRED_MS_MAX / 1000,
                interval_s=AUDIT_EVERY_MS / 1000,
            )
        if self.rotten:
            (name, key), rotted_at = min(self.rotten.items(), key=lambda item: item[1])
            self.check(
                self._raise,
                Violation(
                    10,
                    f"{name}: segment {key.stream_id}/{key.epoch}, rotted at {rotted_at} ms, "
                    f"not sound again {REPAIRED_MS_MAX} ms after the run converged"
                    + ("" if (name, key) in self.rot_found else "; its scrub never found it"),
                ),
            )
            return
        short = self._rotted_short_of_n()
        if short is not None:
            key, sound = short
            self.check(
                self._raise,
                Violation(
                    10,
                    f"segment {key.stream_id}/{key.epoch}: {len(sound)} sound replicas "
                    f"({sound}) of {self.config.policy.replicas}, {REPAIRED_MS_MAX} ms after "
                    "the run converged",
                ),
            )

    def _rotted_short_of_n(self) -> tuple[SegmentKey, list[str]] | None:
        """The first segment a rotted replica was found in that is still sealed and has
        fewer than N sound replicas, with those it has."""
        state = self.masters.state
        if state is None:
            return None
        for key in sorted({key for _, key in self.rot_found}):
            segment = state.segments.get((key.stream_id, key.epoch))
            if segment is None or not segment.final_index:
                continue
            sound = self._sound_replicas(key, segment.final_index, segment.copy_set)
            if len(sound) < self.config.policy.replicas:
                return key, sound
        return None

    @staticmethod
    def _raise(violation: Violation) -> None:
        raise violation

    # ---- liveness ----

    async def _start_liveness(self) -> None:
        self.phase = "liveness"
        self.note("liveness phase: faults off, network healed, every node back")
        self.network.faults = Faults.none()
        self.network.heal()
        embedded = self.masters.embedded
        if embedded is not None and embedded.name not in self.nodes:
            self.start(embedded.name, embedded.serve())
        etcd = self.masters.etcd
        if etcd is not None and not etcd.running:
            etcd.restart()
        for master in self.masters.elected:
            # A clean stop takes a while (it gives its lease back), never longer than
            # any node's: a wait without that bound hung the run (seed 1127).
            try:
                async with asyncio.timeout(STOP_MS_MAX / 1000):
                    await master.ended()
            except TimeoutError:
                raise RuntimeError(f"{master.name} still stopping after {STOP_MS_MAX} ms") from None
            if not master.running:
                master.restart()
        for name in sorted(self.stores):
            if name not in self.nodes:
                self._restart_store(name, {})
        for process in self.processes:
            if process.node not in self.nodes:
                process.incarnation += 1
                self.start(process.node, self._process(process))
        self._check_converged()  # every stream may be gone already

    def _check_converged(self) -> None:
        if self.phase != "liveness" or self._unmarked():
            return
        for stream, checker in self.checkers.items():
            if any(checker.missing(name) for name in self._followers_of(stream)):
                return
        self.note("converged")
        # Writers and producers go on appending: what they ack from here on may not
        # have reached the followers by the final check (seed 1877).
        self.acked_at_convergence = {
            stream: frozenset(checker.acked_sequences) for stream, checker in self.checkers.items()
        }
        self.finished.set()

    def _unmarked(self) -> list[str]:
        """Streams whose liveness marker is still owed (not those the master removed)."""
        return [s for s in self.stream_names if s not in self.markers and s not in self.removed]

    def _raise_stuck(self) -> None:
        unmarked = self._unmarked()
        for writer_id in sorted(self.writers):
            if writer_id.partition("/")[2].partition("#")[0] in unmarked[:5]:
                self._describe(writer_id)
        missing = {
            f"{stream}@{name}": len(checker.missing(name))
            for stream, checker in sorted(self.checkers.items())
            for name in self._followers_of(stream)
            if checker.missing(name)
        }
        raise Violation(
            0,
            f"no convergence within {LIVENESS_MS} ms: streams without an acked marker "
            f"{unmarked[:5]}{'...' if len(unmarked) > 5 else ''}; followers missing {missing}",
        )


@contextlib.contextmanager
def _observing_writes(
    observe: Callable[[str, str, str, grpc.StatusCode], None],
) -> Iterator[None]:
    """`framed.connect` telling `observe` (as `SimNetwork.call_observers` hear a gRPC
    call) each status a data-plane connection ended with, as a Write's: a writer's
    connection carries its Writes, and a connection refused at its hello (a revoked
    token's) has made no call yet, so a Read's ends are counted with the Writes' (a
    follower's live tails ride connections of their own, whose refusals are nobody's
    Write)."""
    connect = framed.connect

    def ended(address: str, error: framed.CallError) -> None:
        code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
        observe(CURRENT_NODE.get(), address, STORE_WRITE, code)

    @contextlib.asynccontextmanager
    async def observed(address: str, *args: Any, **kwargs: Any) -> AsyncGenerator[Any]:
        try:
            async with connect(address, *args, **kwargs) as connection:
                yield connection
        except framed.CallError as error:
            ended(address, error)
            raise
        except BaseExceptionGroup as group:  # a TaskGroup's, in the `async with` block
            matched, _ = group.split(framed.CallError)
            for leaf in _leaves(matched):
                ended(address, cast(framed.CallError, leaf))
            raise

    with mock.patch.object(framed, "connect", observed):
        yield


@contextlib.contextmanager
def _observing_grants(
    issued: Callable[[Grant], None], taken: Callable[[str, SegmentKey, int], None]
) -> Iterator[None]:
    """Every grant a master issues (`authority.grant_of`, which makes each one) told to
    `issued`, and each a store takes for a Seal or a Write stream's epoch, once its
    check answered (`StoreAuthority.grant_for`), to `taken` (store, segment, epoch)."""
    grant_of = authority_core.grant_of
    grant_for = StoreAuthority.grant_for

    def issuing(*args: Any, **kwargs: Any) -> Grant:
        grant = grant_of(*args, **kwargs)
        issued(grant)
        return grant

    def taking(authority: StoreAuthority, *args: Any) -> Grant:
        grant = grant_for(authority, *args)
        _principal, _rpc, _signed, segment, epoch, _now_ms = args
        taken(authority.store_id, segment, epoch)
        return grant

    with (
        mock.patch.object(authority_core, "grant_of", issuing),
        mock.patch.object(StoreAuthority, "grant_for", taking),
    ):
        yield


@contextlib.contextmanager
def _observing_condemnations(
    observe: Callable[[MasterState, tuple[int, int], Sequence[str]], None],
) -> Iterator[None]:
    """The members of a sealed segment any master condemns (counts as differing from
    the certificate) told to `observe` with its state, as the master condemns them: a
    store's scrub report judged (`Integrity.replica_reported`, which also judges the
    reports kept until a seal), and a repair's copy verified against the certificate,
    which condemns the members that disputed it (`Replicas.swap_replica`)."""
    replica_reported = Integrity.replica_reported
    swap_replica = Replicas.swap_replica

    def reported(integrity: Integrity, store_id: str, key: Any, *args: Any) -> Any:
        judgement = replica_reported(integrity, store_id, key, *args)
        if judgement.bad:
            observe(integrity.state, key, judgement.bad)
        return judgement

    def swapped(replicas: Replicas, key: Any, *args: Any) -> Any:
        before = replicas.state.segments.get(key)
        swapped = swap_replica(replicas, key, *args)
        condemned = [m for m in swapped.bad if before is None or m not in before.bad]
        if condemned:
            observe(replicas.state, key, condemned)
        return swapped

    with (
        mock.patch.object(Integrity, "replica_reported", reported),
        mock.patch.object(Replicas, "swap_replica", swapped),
    ):
        yield


@contextlib.contextmanager
def _observing_reports(observe: Callable[[str, str, int, str, str], None]) -> Iterator[None]:
    """Readers' reports of a replica to the master (`ReportReplica`) told to `observe`
    (reader, stream, segment epoch, replica's address, problem) as each reader makes
    them: the SDK's followers and bounded reads (`Follower.report`, of what its cursor
    holds to report) and Spark's (`spark._report`)."""
    follower_report = Follower.report
    spark_report = spark._report

    async def following(follower: Follower, cursor: Cursor) -> None:
        for report in cursor._reports:  # what `report` takes and sends
            node = CURRENT_NODE.get("a reader")
            observe(node, follower._stream, report.epoch, report.replica, report.problem)
        await follower_report(follower, cursor)

    def sparks(part: spark.SegmentRange, address: str, problem: str) -> None:
        observe("spark", part.stream, part.epoch, address, problem)
        spark_report(part, address, problem)

    with (
        mock.patch.object(Follower, "report", following),
        mock.patch.object(spark, "_report", sparks),
    ):
        yield


def _leaves(group: BaseExceptionGroup[Any] | None) -> Iterator[BaseException]:
    for error in group.exceptions if group is not None else ():
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The shells log every fault the nemesis makes: the trace tells what matters."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _flaws(flaws: frozenset[str]) -> Iterator[None]:
    """Switch the named defects back into the shipped code for this run."""
    with contextlib.ExitStack() as stack:
        if "park_forever" in flaws:
            stack.enter_context(
                mock.patch.object(writer_core.Leader, "_append_held", lambda *args: None)
            )
        if "fail_in_doubt" in flaws:
            stack.enter_context(mock.patch.object(writer_shell, "AppendInDoubt", AppendFailed))
        if "ack_before_seal" in flaws:

            def acking_at_once(*args: Any, **kwargs: Any) -> Replicator:
                return Replicator(*args, **{**kwargs, "acking": True})

            stack.enter_context(mock.patch.object(writer_core, "Replicator", acking_at_once))
        if "forget_pending" in flaws:
            stepped_down = writer_shell.Writer._stepped_down

            def forgetting(writer: Writer, down: writer_core.SteppedDown) -> None:
                writer._pending.clear()
                stepped_down(writer, down)

            stack.enter_context(mock.patch.object(writer_shell.Writer, "_stepped_down", forgetting))
        if "revoked_stream_writes" in flaws:
            stack.enter_context(
                mock.patch.object(StoreAuthority, "check_not_revoked", lambda *args: None)
            )
        if "scrub_blind" in flaws:
            done = Scrubber._done

            def blind(scrubber: Scrubber, replica: SegmentKey, result: ScanResult) -> None:
                if not result.damaged:
                    done(scrubber, replica, result)

            stack.enter_context(mock.patch.object(Scrubber, "_done", blind))
        if "scrub_crc_only" in flaws:
            stack.enter_context(mock.patch.object(integrity_core, "judge", _judging_crcs_only))
        if "writer_overturned_by_w" in flaws:
            stack.enter_context(mock.patch.object(integrity_core, "WRITER_OVERTURNED_BY", 1))
        if "condemn_verified_at_once" in flaws:
            judge = integrity_core.judge
            stack.enter_context(
                mock.patch.object(integrity_core, "judge", functools.partial(_at_once, judge))
            )
        if "lost_answered_once" in flaws:
            stack.enter_context(
                mock.patch.object(StoreRegistry, "register_store", _answering_lost_once)
            )
        if "ungranted_writes" in flaws:
            stack.enter_context(mock.patch.object(WriteStreamGrants, "admit", _admitting_anyone))
        if "ignore_grant" in flaws:
            stack.enter_context(mock.patch.object(StoreAuthority, "grant_for", _granting_unchecked))
        if "ignore_fence" in flaws:
            stack.enter_context(
                mock.patch.object(writes_core, "_plan_write", _writing_below_the_fence)
            )
        if "serve_matched" in flaws:
            stack.enter_context(
                mock.patch.object(SegmentStoreCore, "held_meta", _following_to_matched)
            )
            stack.enter_context(mock.patch.object(store_tails, "read_entries", _reading_to_matched))
            stack.enter_context(mock.patch.object(store_reads.ReadCalls, "read", _serving_matched))
        if "copy_unfenced" in flaws:
            stack.enter_context(mock.patch.object(SegmentCopy, "_submit", _copying_unfenced))
        if "pages_by_offset" in flaws:
            stack.enter_context(mock.patch.object(listing, "list_page", pages_by_offset))
        if "standby_state_first" in flaws:
            stack.enter_context(
                mock.patch.object(SegmentHandlers, "SealSegment", _sealing_state_first)
            )
        if "close_waits_for_the_peer" in flaws:
            stack.enter_context(mock.patch.object(framed_peer.Peer, "close", _closing_gracefully))
        if "dial_once" in flaws:
            stack.enter_context(mock.patch.object(framed, "_dial", _dialling_once))
            stack.enter_context(
                mock.patch.object(store_sessions, "reopen_pause_ms", _pausing_after_every_dial)
            )
        if "attention_named_once" in flaws:
            stack.enter_context(
                mock.patch.object(Leadership, "renew_session", _naming_attention_once)
            )
        if "secret_in_grant_only" in flaws:
            stack.enter_context(mock.patch.object(writer_shell, "LeaseSecret", _HandedSecret))
        if "rebuild_from_whoever_answered" in flaws:
            stack.enter_context(mock.patch.object(rebuild_core, "ready", _ready_once_answered))
            named = rebuild_core.named_stores
            stack.enter_context(
                mock.patch.object(
                    rebuild_core, "named_stores", lambda holdings, views=(): named(holdings)
                )
            )
            stack.enter_context(
                mock.patch.object(rebuild_core, "_next_stream_id", lambda *args: None)
            )
        if {"rebuild_from_whoever_answered", "rebuild_without_cards"} & flaws:
            stack.enter_context(mock.patch.object(rebuild_core, "_cards", lambda *args: {}))
        if "rebuild_without_granted_names" in flaws:
            stack.enter_context(mock.patch.object(rebuild_core, "_stream", _naming_without_grants))
        if "bridge_short_everywhere" in flaws:
            stack.enter_context(mock.patch.object(spark, "_packed_batch", _short_at_any_bridge))
        if "chunk_answered_by_acked" in flaws:
            stack.enter_context(
                mock.patch.object(spark, "_certified_answer", lambda check, _: check.next_index - 1)
            )
        if "open_range_read_as_sealed" in flaws:
            stack.enter_context(mock.patch.object(spark, "ReplicaSet", _SealedFromTheStart))
        if "release_acked_untold" in flaws:
            stack.enter_context(mock.patch.object(LeaderAckedOwed, "to_tell", lambda *args: []))
        if "resend_without_dedup" in flaws:
            stack.enter_context(
                mock.patch.object(writer_shell.Writer, "_append_producer", _appending_plainly)
            )
        if "keep_past_gap" in flaws:
            stack.enter_context(mock.patch.object(sr, "plan_recovery", _keeping_past_gaps))
        if "trust_any_bridge" in flaws:
            stack.enter_context(
                mock.patch.object(SegmentRecovery, "lost_from_index", _trusting_any_bridge)
            )
            # The check that a seal declaring nothing had R deciders or a bridge the
            # acked index reached came with the fix.
            stack.enter_context(
                mock.patch.object(SegmentRecovery, "_check_seal", lambda *args: None)
            )
        if "skip_by_matched" in flaws:
            stack.enter_context(mock.patch.object(SegmentSealer, "_attempt", _skipping_by_matched))
        if "ack_before_loss" in flaws:
            stack.enter_context(
                mock.patch.object(SegmentSealer, "_seal_at_master", _raising_before_the_loss)
            )
        if "loss_ends_at_final" in flaws:
            stack.enter_context(mock.patch.object(Cursor, "on_segments", _hopping_past_a_loss))
        if "short_read" in flaws:
            stack.enter_context(mock.patch.object(Cursor, "next", _giving_up_as_finished))
        if "bridge_unheard" in flaws:
            stack.enter_context(mock.patch.object(Cursor, "_bridge_unlisted", _never_unlisted))
        yield


def _at_once(judge: Callable[..., Judgement], *args: Any) -> Judgement:
    """`integrity.judge` condemning what it would have read again first."""
    judged = judge(*args)
    if not judged.recheck:
        return judged
    return Judgement(bad=judged.recheck, note=judged.note)


def _never_unlisted(cursor: Cursor, bridge_index: int) -> bool:
    """`Cursor._bridge_unlisted` deaf to every bridge."""
    return False


async def _appending_plainly(
    writer: Writer, payloads: tuple[bytes, ...], first_sequence: int
) -> list[int]:
    """`Writer._append_producer` without the producer table: a producer's batch goes as
    a plain append, without its mark, so a resend of events already in the stream
    writes them again."""
    first, last = await writer._append(payloads)
    return list(range(first, last + 1))


class _SealedFromTheStart(ReplicaSet):
    """Spark's replica rules as they were: every range's replicas judged as a sealed
    segment's, from the start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.segment_sealed()

    def choose(self, replicas: tuple[str, ...], sealed: bool, next_index: int, now_ms: int) -> Any:
        return super().choose(replicas, True, next_index, now_ms)


_READY = rebuild_core.ready


def _ready_once_answered(
    registered: Any,
    answered: Any,
    named: Any,
    now_ms: int,
    deadline_ms: int,
    earliest_ms: int = 0,
    *,
    joined: Any,
) -> bool:
    """`rebuild.ready` as it was: any store's answer will do, one with a new disk too."""
    answered = set(answered)
    return _READY(registered, answered, named, now_ms, deadline_ms, earliest_ms, joined=answered)


def _short_at_any_bridge(
    part: spark.SegmentRange, reply: segment_store_pb2.ReadReply, next_index: int
) -> tuple[pa.RecordBatch | None, int]:
    """`spark._packed_batch` as it was: a bridge in any range is a short read."""
    packed = Packed.of(reply)
    if packed is not None and EntryKind.BRIDGE in packed.kinds:
        raise spark._ShortRead(f"segment {part.epoch} ends before index {part.last_index}")
    return _shipped_packed_batch(part, reply, next_index)


_shipped_packed_batch = spark._packed_batch


async def _sealing_state_first(
    handlers: SegmentHandlers, request: master_pb2.SealSegmentRequest, context: Any
) -> entry_pb2.Segment:
    """`SealSegment` as it was: the reply's first argument, the active state, evaluated
    before the call that refuses a standby (which has none: AssertionError, UNKNOWN)."""

    def seal(now: int) -> Any:
        principal = handlers.calls.caller(context, "SealSegment")
        (answer,) = handlers._seal([request], principal, now)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return replies.segment_pb(
        handlers.state, await handlers.calls.call(context, "SealSegment", seal)
    )


def _answered_as_a_standby(what: str, code: str, became_active: bool) -> None:
    if code in badinput.UNCLEAR:
        raise Violation(6, what)
    if code == "OK" and not became_active:
        raise Violation(6, f"{what}, answered as though active")


async def _dialling_once(host: str, port: int) -> tuple[Any, Any]:
    """`framed._dial` as it was: one SYN, left to the kernel's retransmissions."""
    return await framed.open_connection(host, port)


_rebuilt_stream = rebuild_core._stream


def _naming_without_grants(
    stream_id: int,
    group: list[rebuild_core.Holding],
    notes: list[str],
    card: StreamRecord | None,
) -> StreamRecord:
    """`rebuild._stream` as it was: blind to the names the stores kept from grants."""
    blind = [dataclasses.replace(holding, stream_name="") for holding in group]
    return _rebuilt_stream(stream_id, blind, notes, card)


async def _closing_gracefully(peer: framed_peer.Peer) -> None:
    """`Peer.close` as it was: a graceful close, waiting for the buffer to go out."""
    peer.writer.close()
    with contextlib.suppress(OSError, asyncio.CancelledError):
        await peer.writer.wait_closed()


def _pausing_after_every_dial(failures: int, unanswered_dial: bool) -> int:
    """`reopen_pause_ms` as it was: the backoff's pause after a dial nobody answered too."""
    return STORE_STREAM_REOPEN.delay_ms(failures)


_renew_session = Leadership.renew_session


def _naming_attention_once(
    leadership: Leadership, session: bytes, principal: str, now_ms: int
) -> SessionRenewal:
    """`Leadership.renew_session` as it was: a stream named once, heard or not."""
    held = leadership.sessions.get(session)
    if held is not None:
        held.unheard = set()
    return _renew_session(leadership, session, principal, now_ms)


class _HandedSecret(LeaseSecret):
    """`LeaseSecret` as it was: nothing to show until a grant's answer hands a secret."""

    def __init__(self) -> None:
        super().__init__()
        self._secret = b""


def _judging_crcs_only(
    certificate: Certificate | None,
    certified_by: str,
    checks: integrity_core.SegmentChecks,
    copy_set: tuple[str, ...],
    write_quorum: int,
    store: str,
    report: integrity_core.Report,
    now_ms: int,
) -> integrity_core.Judgement:
    """The flaw `scrub_crc_only`: a replica its store's scrub read back with every
    crc32c holding counts as holding the segment's certificate, whatever its content
    (the master compares crcs, not the certificate): a copy forged under a valid crc32c
    is never condemned, nor replaced."""
    if (
        certificate is not None
        and isinstance(report, integrity_core.Clean)
        and report.certificate.final_index == certificate.final_index
    ):
        report = integrity_core.Clean(certificate)
    return _judge(certificate, certified_by, checks, copy_set, write_quorum, store, report, now_ms)


_judge = integrity_core.judge
_register_store = StoreRegistry.register_store


def _answering_lost_once(registry: StoreRegistry, store_id: str, *args: Any, **kwargs: Any) -> Any:
    """`register_store` as it was: the lost replicas answered only to the registration
    that changed the incarnation, none to a retry of it."""
    existing = registry.state.stores.get(store_id)
    registered = _register_store(registry, store_id, *args, **kwargs)
    new = registry.state.stores[store_id]
    if existing is not None and existing.incarnation == new.incarnation:
        return dataclasses.replace(registered, lost=())
    return registered


_lost_from_index = SegmentRecovery.lost_from_index


def _trusting_any_bridge(recovery: SegmentRecovery) -> int:
    """`lost_from_index` as it was: nothing lost wherever the plan found a bridge."""
    plan = recovery.plan
    if plan is not None and plan.existing_bridge:
        return 0
    return _lost_from_index(recovery)


_attempt = SegmentSealer._attempt


async def _skipping_by_matched(sealer: SegmentSealer, request: sr.Request) -> sr.Event | None:
    """`SegmentSealer._attempt` trusting a store's matched index (its seal answer's): a
    rewrite of indexes the store holds already is answered as held without being sent,
    so its stale copies, or what it holds where the bridge goes, stay."""
    if isinstance(request, sr.SendRewrite):
        seal = sealer.op._sealed.get(request.store)
        first, last = request.entries[0].index, request.entries[-1].index
        if seal is not None and last <= seal.matched_index:
            held = tuple(entry.epoch for entry in request.entries)
            return sr.WriteAnswered(request.store, first, last, held, 0)
    return await _attempt(sealer, request)


_seal_at_master = SegmentSealer._seal_at_master


async def _raising_before_the_loss(
    sealer: SegmentSealer, action: sr.SealAtMaster
) -> sr.Event | None:
    """`SegmentSealer._seal_at_master` as it was accepting loss: every holder's acked
    index raised to the bridge first, and the loss recorded at the master only once
    they all answered raised (no answer until then: the core asks again)."""
    if action.lost_from_index:
        final = action.final_index
        raises = [sealer._write_call(store, (), final)() for store in sealer.op.holding()]
        answers = await asyncio.gather(*raises, return_exceptions=True)
        if not all(isinstance(a, sr.WriteAnswered) and a.acked_index >= final for a in answers):
            return None
    return await _seal_at_master(sealer, action)


_on_segments = Cursor.on_segments


def _hopping_past_a_loss(cursor: Cursor, segments: Sequence[SegmentView], now_ms: int) -> None:
    """`Cursor.on_segments` as it was: a position past the bridge of a segment sealed
    accepting loss (read there from a replica since destroyed) hops on to the next
    segment, as though the loss ended at the bridge: what the lost replicas held past
    it is never told."""
    _on_segments(cursor, segments, now_ms)
    current = cursor._current_segment()
    if (
        current is not None
        and current.sealed
        and 0 < current.lost_from_index <= cursor._next_index
        and cursor._next_index > current.final_index
    ):
        cursor._hop()
        cursor._advanced_ms = now_ms


_next = Cursor.next


def _giving_up_as_finished(cursor: Cursor, now_ms: int) -> Next:
    """`Cursor.next` taking giving up for the end: a bounded read that no replica can
    serve ends as though its range were read (`Finished`, the short answer of issue
    #36), not `Unreachable` (which the SDK raises as Unavailable)."""
    decision = _next(cursor, now_ms)
    return Finished() if isinstance(decision, Unreachable) else decision


def _keeping_past_gaps(*args: Any, end_at_first_gap: bool = False, **kwargs: Any) -> RecoveryPlan:
    """`plan_recovery` as a plain stream's recovery runs it, for a producer's stream
    too: the run goes on past an index no store holds (a HOLE there), keeping a
    producer's batch past a lost earlier one."""
    return plan_recovery(*args, **kwargs)


def _admitting_anyone(
    grants: WriteStreamGrants, signed: bytes, segment: SegmentKey, writer_epoch: int, now_ms: int
) -> Grant:
    """The flaw `ungranted_writes`: a write that shows no grant, and whose Write stream
    showed none, is let through as though granted (the intruder's writes then meet the
    fence, not the grant)."""
    try:
        return _admit(grants, signed, segment, writer_epoch, now_ms)
    except GrantRefused:
        if signed:
            raise
    listed = (GrantSegment(segment.epoch, (grants.authority.store_id,)),)
    return Grant(segment.stream_id, writer_epoch, "anyone", "anyone", listed, now_ms + 60_000)


_admit = WriteStreamGrants.admit


_grant_for = StoreAuthority.grant_for


def _granting_unchecked(
    authority: StoreAuthority,
    principal: Principal,
    rpc: str,
    signed: bytes,
    segment: SegmentKey,
    epoch: int,
    now_ms: int,
) -> Grant:
    """The flaw `ignore_grant`: the store's grant check (a Seal's, and a Write stream's
    grant when one is shown) lets through whatever grant it shows: none, a forged one,
    one of another epoch, segment or store, an expired one. A grant shown is taken at
    its word, its signature unread; without one, the write or seal goes as anyone's."""
    try:
        return _grant_for(authority, principal, rpc, signed, segment, epoch, now_ms)
    except GrantRefused:
        if not 0 < segment.epoch <= epoch:
            raise  # no grant of any kind could list it
    with contextlib.suppress(MalformedPayload, AssertionError):
        return Grant.decode(signed[MAGIC_BYTES + KEY_ID_BYTES : -SIGNATURE_BYTES])
    listed = (GrantSegment(segment.epoch, (authority.store_id,)),)
    return Grant(segment.stream_id, epoch, "anyone", "anyone", listed, now_ms + 60_000)


_plan_write = writes_core._plan_write


def _writing_below_the_fence(command: WriteCommand, work: Any) -> WriteResult:
    """The flaw `ignore_fence`: a write below its segment's fence is planned as though
    written at the fence (a stale leader's batch lands on a replica a seal fenced)."""
    meta = work.meta(command.segment)
    if meta is not None and command.writer_epoch < meta.fence:
        command = dataclasses.replace(command, writer_epoch=meta.fence)
    return _plan_write(command, work)


_held_meta = SegmentStoreCore.held_meta
_read_entries = store_reads.read_entries
_read = store_reads.ReadCalls.read


def _following_to_matched(core: SegmentStoreCore, segment: SegmentKey) -> SegmentMeta:
    """`held_meta` as the flaw `serve_matched` has it, for the tails that follow it: the
    segment's acked index taken for its matched one (what the store holds, not what it
    was told is acked)."""
    meta = _held_meta(core, segment)
    return dataclasses.replace(meta, acked_index=meta.matched_index)


def _reading_to_matched(
    core: SegmentStoreCore,
    segment: SegmentKey,
    first: int,
    upper: int,
    acked_only: bool,
    limit: int,
    verify: bool = True,
) -> list[entry_pb2.Entry]:
    """`read_entries` as the flaw `serve_matched` has it: a tail's acked-only read goes
    up to the matched index."""
    if acked_only:
        meta = core.catalog.meta(segment)
        upper = min(upper, meta.matched_index) if meta is not None else upper
    return _read_entries(core, segment, first, upper, False, limit, verify)


async def _serving_matched(
    calls: store_reads.ReadCalls, request: segment_store_pb2.ReadRequest, caller: Principal
) -> AsyncGenerator[segment_store_pb2.ReadReply, None]:
    """`ReadCalls.read` as the flaw `serve_matched` has it: an acked-only Read served up
    to the matched index, which its replies give as the acked index."""
    meta = calls.store.core.catalog.meta(segment_key(request.segment))
    matched = meta.matched_index if meta is not None and request.acked_only else 0
    served = request
    if matched >= max(request.from_index, 1):
        served = segment_store_pb2.ReadRequest()
        served.CopyFrom(request)
        served.acked_only = False
        served.to_index = min(request.to_index or matched, matched)
    async with contextlib.aclosing(_read(calls, served, caller)) as replies:
        async for reply in replies:
            reply.acked_index = max(reply.acked_index, matched)
            yield reply


_submit_copy = SegmentCopy._submit


async def _copying_unfenced(copy: SegmentCopy, command: Command) -> Outcome:
    """The flaw `copy_unfenced`, CopySegment as it was: the copy's fence a delete of
    the copy (its fence with it), then every batch written acked up to the final index,
    before the digest is compared."""
    if isinstance(command, SealCommand):
        command = DeleteCommand(command.segment)
    elif isinstance(command, WriteCommand) and command.acked_index == 0:
        command = dataclasses.replace(command, acked_index=copy.op.final_index)
    return await _submit_copy(copy, command)


def _seeded_secrets(seed: int) -> types.SimpleNamespace:
    """What the master's token calls draw from `secrets`, drawn from the seed instead
    (a generator of their own: the loop's draws stay where they were), so that a run
    replays."""
    draws = random.Random(f"{seed}/tokens")

    def token_hex(nbytes: int) -> str:
        return draws.getrandbits(8 * nbytes).to_bytes(nbytes).hex()

    return types.SimpleNamespace(token_hex=token_hex)


def _refused_for_now() -> dict[str, int]:
    """The write batches the stores of this process refused for now so far, by why
    (their metrics counters: the world sees the refusals without a hook in the store)."""
    counters = {
        "writes refused busy": store_metrics.REFUSED_BUSY,
        "writes refused over quota": store_metrics.REFUSED_QUOTA,
    }
    return {
        what: int(
            next(s.value for m in c.collect() for s in m.samples if s.name.endswith("_total"))
        )
        for what, c in counters.items()
    }


def run_seed(
    seed: int,
    flaws: frozenset[str] = frozenset(),
    trace: Callable[[str], None] | None = None,
    overrides: dict[str, Any] | None = None,
) -> WorldResult:
    """One seed of the world on the runtime; `overrides` replace drawn configuration
    fields (the rest of the run still draws what the seed draws)."""
    started = time.perf_counter()
    rng = random.Random(seed)
    config = WorldConfig.draw(seed, rng, flaws)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    result = WorldResult(config)
    worlds: list[World] = []

    async def main() -> None:
        network = SimNetwork(
            asyncio.get_running_loop(),
            stream_faults=StreamFaults(send_buffer_bytes=config.send_buffer_bytes),
        )
        with network.installed():
            async with asyncio.TaskGroup() as group:
                world = World(config, rng, network, group, trace)
                worlds.append(world)
                try:
                    with (
                        _observing_writes(world._call_ended),
                        _observing_condemnations(world._condemned),
                        _observing_reports(world._reader_reported),
                        _observing_grants(world._grant_issued, world._grant_taken),
                    ):
                        await world.run()
                finally:
                    await world.stop_all()

    refused_before = _refused_for_now()
    try:
        with (
            _quiet(),
            _flaws(config.flaws),
            mock.patch.object(master_link, "_free_bytes", lambda path: SIM_DISK_FREE_BYTES),
            mock.patch.object(service_tokens, "secrets", _seeded_secrets(seed)),
        ):
            run(main(), seed)
    except Exception:
        result.error = traceback.format_exc()
    finally:
        for world in worlds:
            world.close_disks()
    if worlds:
        world = worlds[0]
        result.violation = world.violation
        result.virtual_ms = world.now_ms
        result.trace = world.lines
        result.stats = world.stats
        if "answers lost" in world.network.stats:
            result.stats["answers lost"] = world.network.stats["answers lost"]
        for what, count in _refused_for_now().items():
            if count > refused_before[what]:
                result.stats[what] = count - refused_before[what]
        result.acked = sum(len(c.acked) for c in world.checkers.values())
        result.read = sum(
            len(record.seen) for c in world.checkers.values() for record in c.followers.values()
        )
        result.unsynced_losses = [
            loss for c in world.checkers.values() for loss in c.unsynced_losses
        ]
    result.seconds = time.perf_counter() - started
    return result
