"""What the servers, the SDK and the tools share, below all of them.

Entry encoding and checksums, sequences, replication policies, named limits, status
metadata keys, channel options and the log format. Nothing here imports the SDK, the
master or the store; `entry`, `limits`, `policy` and `sequence` do no I/O, so the
protocol cores may use them.
"""
