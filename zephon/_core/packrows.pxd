# The packed-rows kernel publishes no C-level layout: it is reached from Python only
# (zephon.ops.packing). Kept so that every kernel ships a .pxd beside its .pyx.
