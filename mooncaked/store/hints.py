"""Where a client last saw each object: lets a get copy the bytes while the master answers.

A get normally waits for the master's lookup (which grants the read lease), then copies.
When the client already knows where the object sat (it put the object, or read it before),
it sends the lookup, copies from that place while the lookup is in flight, and keeps the copy
only if it hashes to the checksum the master then answers for the key. Bytes that hash to
the committed checksum are the committed object's bytes, so the get returns what a plain get
would; a copy that does not match (the place was freed and reused meanwhile) is dropped
without counting as corruption, and the object is read again from the master's answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mooncaked.proto.mooncake.v1 import store_pb2


@dataclass(frozen=True, slots=True)
class Hint:
    """One copy of an object as last seen (what it must hash to comes from the lookup, not from here)."""

    address: str  # the holder's transfer address
    region: str
    offset: int
    size: int
    checksum: int = 0  # as last seen: what an owner read by key asks for (the lookup's answer decides otherwise)
    key_server: str = ""  # where the holder serves reads by key (owner_server.py); "": it does not
    host_id: str = ""  # the holder's host (shared memory reaches it from the same host)
    shm_name: str = ""  # the holder's segment in shared memory ("": none); its owner index is named after it


class Hints:
    """A bounded LRU of key -> Hint (0 entries: off)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_key: OrderedDict[str, Hint] = OrderedDict()

    def note(self, key: str, replica: store_pb2.Replica, size: int, checksum: int = 0) -> None:
        if self.capacity <= 0:
            return
        e = replica.endpoint
        self._by_key[key] = Hint(e.address, e.region, replica.offset, size, checksum, e.key_server,
                                  e.same_host_id, e.shm_name)
        self._by_key.move_to_end(key)
        if len(self._by_key) > self.capacity:
            self._by_key.popitem(last=False)

    def note_objects(self, objs: Iterable[store_pb2.ObjectReplicas]) -> None:
        for o in objs:
            if o.replicas:
                self.note(o.key, o.replicas[0], o.size, o.checksum)

    def pick(self, keys: Sequence[str]) -> list[tuple[str, Hint]]:
        """The keys of `keys` with a hint, and their hints."""
        by_key = self._by_key
        if not by_key:
            return []
        return [(k, h) for k in keys if (h := by_key.get(k)) is not None]

    def get(self, key: str) -> Hint | None:
        return self._by_key.get(key)

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            self._by_key.pop(k, None)
