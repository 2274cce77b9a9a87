"""File sources that read each shard through a layout built once from the shard or its sidecar
(MDS offsets, the WebDataset member index, a token shard's document table): the layouts are kept
by the source, dropped when it is pickled, and loaded again in the worker, which must find the
same content identity the source was built on.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Generic, Protocol, TypeVar

from zephon.sources.files import FileSource

__all__ = ["ShardLayoutSource"]


class _Layout(Protocol):
    @property
    def identity(self) -> str: ...


LayoutT = TypeVar("LayoutT", bound=_Layout)


class ShardLayoutSource(FileSource, Generic[LayoutT]):
    """A ``FileSource`` whose reads go through one layout per file, made by ``_load_shard``.

    ``load_shards`` (called from ``load_metadata``) loads every layout; ``_shard(i)`` returns
    file ``i``'s, loading it again after unpickling and refusing it when the file's content
    identity is no longer the one the source was built on.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._shards: list[LayoutT | None] = []
        self._identities: list[str] = []

    @abstractmethod
    def _load_shard(self, i: int) -> LayoutT:
        """File ``i``'s layout, from its sidecar when that still describes the file, else built
        from the file (and stored in a new sidecar)."""

    def load_shards(self) -> list[LayoutT]:
        """Load or build each file's layout (in parallel for remote data, each retried on
        transient errors) and keep them with their identities."""
        shards: list[LayoutT] = self.index_every_file(self._load_shard)
        self._shards = list(shards)
        self._identities = [s.identity for s in shards]
        return shards

    def _shard(self, i: int) -> LayoutT:
        # Made the first time a read needs it (after unpickling in a worker), under the lock,
        # and refused when its identity is no longer the one the source was built on.
        layout = self._shards[i]
        if layout is None:
            with self._lock:
                layout = self._shards[i]
                if layout is None:
                    layout = self.indexed(i, self._load_shard)
                    if layout.identity != self._identities[i]:
                        raise self.fetch_error(
                            i,
                            "the file changed since this source read it (another content "
                            "digest); build a new source (its fingerprint will differ from old "
                            "checkpoints)",
                        )
                    self._shards[i] = layout
        return layout

    def __getstate__(self) -> dict[str, Any]:
        # Without the layouts: a worker loads them again and checks they describe the same
        # content (``_shard``).
        state = super().__getstate__()
        state["_shards"] = [None] * len(self._shards)
        return state
