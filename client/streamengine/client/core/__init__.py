"""The SDK's protocol core: plain Python with no I/O, no clock and no randomness.

Inputs (messages, the time) come in as values; decisions come out as values. The
asyncio/gRPC shells in `client/` and the simulator in `tests/sim/` drive the same code.
"""
