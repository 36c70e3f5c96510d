"""The `streamengine` command: the ops CLI, the local cluster, certificates and tokens."""
