# The collate kernel publishes no C-level layout: its loop is reached from Python only
# (zephon.ops.batching). Kept so that every kernel ships a .pxd beside its .pyx.
