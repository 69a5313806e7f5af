"""The Responses API's store: responses kept in memory (`store: true`, the default) so a client can
read them back (GET /v1/responses/{id}) and continue from them (`previous_response_id`).

Bounded: `--max-stored-responses` entries, the least recently used dropped first (a read or a
continuation counts as a use). Each entry holds the whole conversation up to and including its
answer, not a link to its parent, so an eviction in the middle of a chain cannot silently shorten a
later turn's history: the lookup finds everything or nothing. Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as returned
    conversation: list[dict]  # chat messages (ChatMessage's fields) up to and including the answer


class ResponseStore:
    def __init__(self, max_size: int):
        if max_size < 0:
            raise ValueError(f"--max-stored-responses must be >= 0, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_size == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
