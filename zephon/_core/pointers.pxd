# The pointer-row kernel publishes no C-level layout: it is reached from Python only
# (zephon.sources.base). Kept so that every kernel ships a .pxd beside its .pyx.
