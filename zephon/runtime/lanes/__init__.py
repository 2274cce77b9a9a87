"""One lane: its chunks through the operator chain, the control items that travel beside its
records, and the snapshots of what its stateful operators hold."""
