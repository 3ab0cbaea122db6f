"""Stand-in digests for a Prompt Cache prompt's module blocks, so its own blocks are prefix-cached
behind exactly its set of modules.

Module blocks hold KV encoded without the rest of the prompt, so they cannot carry the usual chain
of content digests: the blocks after them would then be found under any prompt that shares the
tokens. Instead the chain runs over the pieces' keys (and the recovery setting, whose recomputed
rows change the KV the own blocks are computed over). A request's set of pieces repeats (one schema,
many questions), so the digests are remembered.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from prefixserve.promptcache.recompute import Recompute

CACHE_SIZE = 256  # sets of pieces whose stand-in digests are remembered


def stand_in_digests(
    pieces: Sequence[tuple[str, int]], recompute: Recompute, salt: str | None
) -> list[bytes]:
    """Digests for a table's module blocks, given each piece's (key, number of blocks) in order."""
    h = hashlib.blake2b(b"prompt-modules", digest_size=16)
    if recompute.kind != "none":
        h.update(recompute.spec.encode())
    digests: list[bytes] = []
    # ``block_digest(parent, [i], [], salt)`` inlined (the same bytes): it built two arrays per
    # block, ~6 ms of host time per 320 module blocks (issue 54)
    tail = b"||" + (salt or "").encode()
    most = max((n for _, n in pieces), default=0)
    index = array("q", range(most)).tobytes()
    blake2b = hashlib.blake2b
    for key, blocks in pieces:
        h.update(key.encode())
        parent = h.digest()
        for lo in range(0, 8 * blocks, 8):
            parent = blake2b(parent + index[lo : lo + 8] + tail, digest_size=16).digest()
            digests.append(parent)
    return digests


class StandInDigests:
    """``stand_in_digests`` remembered for the last ``CACHE_SIZE`` sets of pieces."""

    def __init__(self) -> None:
        self._found: OrderedDict[tuple[tuple[tuple[str, int], ...], str, str | None], list[bytes]] = (
            OrderedDict()
        )

    def __call__(
        self, pieces: Sequence[tuple[str, int]], recompute: Recompute, salt: str | None
    ) -> list[bytes]:
        """The digests (a copy: the caller may keep it)."""
        key = (tuple(pieces), recompute.spec if recompute.kind != "none" else "", salt)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = stand_in_digests(pieces, recompute, salt)
            if len(self._found) > CACHE_SIZE:
                self._found.popitem(last=False)
        else:
            self._found.move_to_end(key)
        return list(found)


__all__ = ["CACHE_SIZE", "StandInDigests", "stand_in_digests"]
