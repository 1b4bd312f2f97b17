"""DCP metadata encoded once per layout: the same ``Metadata`` object again gives the same document.

:class:`shoal.dcp.SavePlanner` hands DCP the very ``Metadata`` object of the last save while the
state's layout is unchanged (its plan cache); DCP's ``finish`` then fills in that save's storage
data. Encoding it (:func:`~shoal.format.dcp_codec.encode_metadata`: a dict per item and chunk)
costs about 10 us an item on every save. :class:`MetadataEncoder` keeps the last document and
gives it again when the object is the same one, with equal storage data and the same parts
otherwise; anything else is encoded anew. The document is shared between those checkpoints and
must not be changed by its users (nothing in shoal changes one).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from shoal.format.dcp_codec import encode_metadata


@dataclass(frozen=True)
class _Last:
    metadata: Metadata
    state_dict_metadata: Any
    planner_data: Any
    storage_data: Any
    storage_meta: Any
    document: Mapping[str, Any]


class MetadataEncoder:
    """``encode_metadata`` with the last document kept, and its JSON (thread-safe; each
    :class:`~shoal.engine.runtime.Runtime` has one)."""

    def __init__(self) -> None:
        self._last: _Last | None = None
        self._json: tuple[Mapping[str, Any], str] | None = None
        self._lock = threading.Lock()
        self.reused = 0

    def json_of(self, document: Mapping[str, Any]) -> str:
        """``document`` as JSON; the last call's text again when it is the very same document (one
        :meth:`encode` gave again: none is ever changed, so an ``is`` check is sound)."""
        with self._lock:
            last = self._json
        if last is not None and last[0] is document:
            return last[1]
        text = json.dumps(document)
        with self._lock:
            self._json = (document, text)
        return text

    def encode(self, metadata: Metadata) -> Mapping[str, Any]:
        with self._lock:
            last = self._last
        if (
            last is not None
            and last.metadata is metadata
            and last.state_dict_metadata is metadata.state_dict_metadata
            and last.planner_data is metadata.planner_data
            and last.storage_meta == metadata.storage_meta
            and last.storage_data == metadata.storage_data
        ):
            self.reused += 1
            return last.document
        document = encode_metadata(metadata)
        with self._lock:
            self._last = _Last(
                metadata,
                metadata.state_dict_metadata,
                metadata.planner_data,
                # finish() assigns a new dict each save; a copy guards against one changed in place
                dict(metadata.storage_data)
                if isinstance(metadata.storage_data, dict)
                else metadata.storage_data,
                metadata.storage_meta,
                document,
            )
        return document


__all__ = ["MetadataEncoder"]
