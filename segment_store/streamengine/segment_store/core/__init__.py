"""Pure decisions: no I/O, no clock, no randomness (tests/test_layering.py)."""
