"""Metadata keys that carry structured facts beside a gRPC status.

Servers set them and the SDK reads them: both import this one definition.
"""

from __future__ import annotations

# Trailing metadata of a FAILED_PRECONDITION a store answers to a write or seal below its
# fence: the fence itself, so a writer learns which epoch superseded it.
FENCE_METADATA_KEY = "se-fence"

# Trailing metadata of the INVALID_ARGUMENT a store answers to an entry or a batch over
# its size bound: the bound exceeded, in bytes, so the SDK raises EventTooLarge without
# reading the status text.
TOO_LARGE_METADATA_KEY = "se-too-large"

# The fence to assume when a store refuses below its fence without saying which: above
# every epoch (epochs fit 31 bits), so the writer steps down rather than retry.
FENCE_UNKNOWN = 1 << 63

# Trailing metadata of the UNAVAILABLE a standby master answers: the address of the
# active master, when the standby knows it (`masters.next_master` follows it).
ACTIVE_MASTER_METADATA_KEY = "se-active-master"

# Trailing metadata of the FAILED_PRECONDITION the master answers for a stream deleted and
# pending removal: when its data goes (wall-clock ms), so the SDK raises StreamDeleted.
DELETED_UNTIL_METADATA_KEY = "se-deleted-until"
