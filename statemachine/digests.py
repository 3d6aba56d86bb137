"""The hex digests that name things by their content: sample ids, fingerprints, the token-ids
hash, and the short keys in run and drafter-version folder names. BLAKE2b, fast and stdlib.

Installs have written these values down (folder names, ledgers, contracts, manifests, the shard
each conversation belongs to), so neither the algorithm, nor the sizes, nor the way a caller
serializes what it digests may change: tests/test_digests.py pins them. The dataset's file
checksums are another thing, xxh3 (dataset/checksum.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hashlib import blake2b as Hasher

SIZE = 16  # bytes, 32 hex digits: an identity, never expected to collide
KEY_SIZE = 4  # 8 hex digits: a key beside a name, unique among the few runs or versions one has


def hasher(size: int = SIZE) -> Hasher:
    """A digest fed piece by piece (a file, rows, a stream of chunks); `hexdigest()` at the end."""
    import hashlib  # lazily: eagle3ctl status never digests, and answers in a blink
    return hashlib.blake2b(digest_size=size)


def hex_digest(data: bytes, size: int = SIZE) -> str:
    h = hasher(size)
    h.update(data)
    return h.hexdigest()


def json_digest(value: Any, size: int = SIZE) -> str:
    """The digest of a JSON value with its keys sorted, whatever order its dicts were built in
    (non-ASCII escaped, as json.dumps does by default)."""
    import json  # lazily, as hashlib
    return hex_digest(json.dumps(value, sort_keys=True).encode(), size)
