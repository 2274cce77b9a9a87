# The token-id kernel publishes no C-level layout: it is reached from Python only
# (zephon.ops.tokenize). Kept so that every kernel ships a .pxd beside its .pyx.
