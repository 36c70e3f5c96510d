"""Named limits, each with its reason, and the relations between them.

One place for every bound of the system: the servers and the SDK import these, so a
limit the store enforces is the one the writer respects.
"""

from __future__ import annotations

# Streams one CreateStreams call creates, all in one metadata commit: each stream's
# record and perhaps its new tenant's, and the next stream id, must fit one etcd
# transaction (`metadata.OPS_PER_TRANSACTION_MAX`, under etcd's default 128 operations).
CREATE_STREAMS_PER_CALL_MAX = 50

# A single event: large enough for any record a stream of events should carry, small
# enough that a batch of them fits a gRPC message with room to spare.
EVENT_BYTES_MAX = 1 << 20

# One Write request: bounds the store's memory per queued batch and stays well below
# the gRPC message limit configured on both sides.
WRITE_BATCH_BYTES_MAX = 8 << 20

# Entries in one Write request: the store writes a batch in one RocksDB WriteBatch, and
# rocksdict holds the GIL for a whole write, so a batch stays around a millisecond.
WRITE_BATCH_ENTRIES_MAX = 4096

# Segments' batches in one Write message (`WriteRequest.parts`): a client sends each store
# what its writers queued together. The message's entries and packed bytes over all its
# parts stay within one batch's limits (above), so a message costs the store no more than
# one batch did; a part may be empty (an acked-index tick), so parts are bounded apart,
# as many as a batch has entries. A client counts each part's whole serialized size
# (its grant and fields too) against WRITE_BATCH_BYTES_MAX, so a message of many parts
# fits the gRPC limit below as one batch does.
WRITE_REQUEST_PARTS_MAX = WRITE_BATCH_ENTRIES_MAX

# Protobuf framing beyond the payloads of one message: per entry a few bytes of tags,
# lengths, epoch, index and crc (WRITE_BATCH_ENTRIES_MAX of them), or the lengths of a
# packed read reply, plus the request's own fields.
GRPC_MESSAGE_FRAMING_BYTES_MAX = 1 << 20

# gRPC message limit on every channel and server, received and sent: one batch (which
# may pass its limit by the one event that filled it), or one message of many parts
# holding as much, and its framing. No more: a peer
# sending a larger message is refused by grpc before anything is parsed (the default
# 4 MiB is below one batch).
GRPC_MESSAGE_BYTES_MAX = WRITE_BATCH_BYTES_MAX + EVENT_BYTES_MAX + GRPC_MESSAGE_FRAMING_BYTES_MAX

# The data plane's frames (framing.py, docs/data-plane.md): a payload is one request or
# reply message, so its bound is gRPC's message bound, and a peer announcing a larger one
# is refused from its header, before its payload is read.
FRAME_PAYLOAD_BYTES_MAX = GRPC_MESSAGE_BYTES_MAX
# The fixed header before every payload (framing.HEADER).
FRAME_HEADER_BYTES = 16
# Before the hello is accepted the peer is nobody: its frames are held to this much
# (a hello carries a version range and a token of a few hundred bytes).
HELLO_PAYLOAD_BYTES_MAX = 16 << 10
# Bytes of frames either side may send on one request before its peer grants more:
# one of the largest frames (what gRPC held per stream: a message and a small window);
# credit comes back every half window taken, so many small batches stay in flight.
# What a store buffers for one connection is this many bytes per open request, at most
# DATA_REQUESTS_MAX of them.
STREAM_CREDIT_BYTES = FRAME_HEADER_BYTES + FRAME_PAYLOAD_BYTES_MAX
DATA_REQUESTS_MAX = 64
# The values a store puts in one reply of the data plane (a Read's entries or packed
# values, a Subscribe's batch), cut once they reach it (so past it by one value at
# most). A connection sends each frame whole, so this is what every other request
# sharing it (a tail's batch, a recovery write's answer, a small read) waits behind at
# most per frame ahead of it: a read of a whole segment in frames of 8 MiB held them for
# the time of 8 MiB on the wire. Smaller costs catch-ups: at 256 KiB a read in record
# batches lost 15-25 % of its rate to the fixed costs of four times the replies, while
# at 1 MiB catch-ups read as fast as with 8 MiB. A reader's window (STREAM_CREDIT_BYTES)
# keeps several such frames in flight (ten of small events).
DATA_REPLY_BYTES_MAX = 1 << 20
# Connections of a data port still waiting for their hello (nobody yet: each holds a
# socket and a task for up to the hello's timeout); one past this is closed at once.
DATA_HELLOS_MAX = 256

# Parallel replicating and recovering keeps at most the open segment and one earlier.
UNSEALED_SEGMENTS_MAX = 2

# Copy sets: a policy beyond this is a configuration mistake, not a real deployment.
REPLICAS_MAX = 15

# Indexes are 32 bits wide inside a sequence (epoch << 32 | index).
INDEX_MAX = (1 << 32) - 1
# Epochs fit 31 bits so that a sequence is a non-negative signed 64-bit integer
# (Spark's `long`).
EPOCH_MAX = (1 << 31) - 1

# Stream names: `tenant/stream`, each part bounded so keys and logs stay readable.
NAME_PART_CHARS_MAX = 64

# Leases: the writer heartbeats every lease/3, so a lease survives two lost heartbeats.
LEASE_MS_DEFAULT = 2000
HEARTBEATS_PER_LEASE = 3
# Writers' heartbeats in one LeaseHeartbeat call: a client leading more sends several
# calls an interval. The master decides a batch in one step of its event loop (about
# 0.1 ms an entry), so a batch holds it up for a fraction of a lease at most.
LEASE_BATCH_ENTRIES_MAX = 2048

# Client ids name a writer in grants and logs (a UUID-based id takes 39 characters).
CLIENT_ID_CHARS_MAX = 128

# A writer's lease secret (docs/design.md, "Leadership"): the writer draws it and shows
# it with its every heartbeat, and the master keeps the digest of the one the winning
# heartbeat showed. 256 random bits are never guessed; fewer than 128 are refused.
LEASE_SECRET_BYTES = 32
LEASE_SECRET_BYTES_MIN = 16
LEASE_SECRET_BYTES_MAX = 64
assert LEASE_SECRET_BYTES_MIN <= LEASE_SECRET_BYTES <= LEASE_SECRET_BYTES_MAX

# Per-tenant quotas, defaults of the master's flags (0 there: no limit). Streams: far
# more than one tenant's application needs, few enough that one tenant cannot fill the
# master's memory and every listing with its own. Append bytes per second, per tenant
# and per store: several times what one store writes (tens of MB/s), so that only a
# tenant flooding a store is held back; the store refuses its batches (REFUSED_QUOTA)
# and its leaders resend them later, as under back pressure.
TENANT_STREAMS_MAX_DEFAULT = 1000
TENANT_APPEND_BYTES_PER_S_DEFAULT = 256 << 20

assert WRITE_BATCH_BYTES_MAX >= 2 * EVENT_BYTES_MAX, "a batch must hold the largest event"
assert GRPC_MESSAGE_BYTES_MAX >= WRITE_BATCH_BYTES_MAX + EVENT_BYTES_MAX, "a batch must fit"
assert GRPC_MESSAGE_FRAMING_BYTES_MAX >= 64 * WRITE_BATCH_ENTRIES_MAX, "room for entry framing"
assert STREAM_CREDIT_BYTES >= FRAME_HEADER_BYTES + FRAME_PAYLOAD_BYTES_MAX, "a frame must fit"
assert HELLO_PAYLOAD_BYTES_MAX < FRAME_PAYLOAD_BYTES_MAX
assert STREAM_CREDIT_BYTES >= 4 * (DATA_REPLY_BYTES_MAX + EVENT_BYTES_MAX), "replies in flight"
assert LEASE_MS_DEFAULT > HEARTBEATS_PER_LEASE * 100, "heartbeats must be frequent enough"
assert LEASE_BATCH_ENTRIES_MAX * 0.1 < LEASE_MS_DEFAULT / HEARTBEATS_PER_LEASE, "batch too long"
