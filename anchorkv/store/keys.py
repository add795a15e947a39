"""Anchor names, entry keys and prefix-token hashes.

An *anchor* names a context (``alice-software-tokyo``, also written as the tag
``<alice-software-tokyo/>``). `normalize_anchor` lower-cases it, strips the tag and the
surrounding whitespace, turns inner runs of whitespace into ``-`` and checks it against
`ANCHOR_PATTERN`. A *key* is the blake3 hash of the normalized anchor and the model fingerprint
hash, so paths in the store are built from hex digits only: no name can address anything
outside the store, whatever it contains.

Without an anchor the key is the chain hash of the prompt's first `TOKEN_BLOCK` tokens (a
plain persistent prefix cache); entries under one key differ by prefix length and by
`prefix_hash`, the chain hash over all `TOKEN_BLOCK`-token blocks of the prefix (the last one
may be partial). Hashes never depend on vLLM's block size, which changes with tp.

An optional *scope* (the connector passes a digest of vLLM's ``cache_salt`` and LoRA adapter)
is folded into every key and prefix hash: entries of one scope live under other keys (other
directories) than those of another scope or of none, so a lookup never lists or opens them.
Without a scope every hash is what it was before scopes existed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import blake3
import numpy as np

from anchorkv.store.errors import InvalidAnchor

ANCHOR_MAX_LEN = 128
ANCHOR_PATTERN = re.compile(r"^[a-z0-9](?:[a-z0-9._-]*[a-z0-9])?$")
_TAG = re.compile(r"^<\s*([^<>/]*?)\s*/\s*>$")
#: Tokens per link of the chain hash (and the tokens an anchorless entry needs at least).
TOKEN_BLOCK = 256
_KEY_DOMAIN = b"anchorkv/key/v1\0"
_PREFIX_DOMAIN = b"anchorkv/prefix/v1\0"
_SCOPE_DOMAIN = b"anchorkv/scope/v1\0"


def _scope_bytes(scope: str | None) -> bytes:
    """What a scope adds to a hash's input: nothing without one (unscoped hashes unchanged)."""
    if scope is None or scope == "":
        return b""
    if not isinstance(scope, str):
        raise TypeError(f"a scope must be a str, found {type(scope).__name__}")
    return b"\0scope\0" + blake3.blake3(_SCOPE_DOMAIN + scope.encode()).digest()


def normalize_anchor(anchor: str) -> str:
    """The canonical spelling of `anchor`, or `InvalidAnchor` saying what is wrong.

    Accepts ``Alice-Software-Tokyo``, `` alice software tokyo `` and
    ``<alice-software-tokyo/>``; all give ``alice-software-tokyo``. Allowed: lowercase letters,
    digits, ``.``, ``_`` and ``-`` (not first or last, no ``..``), at most `ANCHOR_MAX_LEN`.
    """
    if not isinstance(anchor, str):
        raise InvalidAnchor(f"an anchor must be a str, found {type(anchor).__name__}")
    if len(anchor) > 4 * ANCHOR_MAX_LEN:
        raise InvalidAnchor(
            f"anchor of {len(anchor)} characters is too long (at most {ANCHOR_MAX_LEN})"
        )
    text = anchor.strip()
    tag = _TAG.match(text)
    if tag:
        text = tag.group(1)
    text = re.sub(r"\s+", "-", text.strip().lower())
    shown = anchor if len(anchor) <= 40 else anchor[:37] + "..."
    if not text:
        raise InvalidAnchor(f"anchor {shown!r} is empty after normalization")
    if len(text) > ANCHOR_MAX_LEN:
        raise InvalidAnchor(
            f"anchor {shown!r} has {len(text)} characters; at most {ANCHOR_MAX_LEN} are allowed"
        )
    if not ANCHOR_PATTERN.match(text) or ".." in text:
        bad = sorted({c for c in text if not re.match(r"[a-z0-9._-]", c)})
        detail = (f"characters {bad!r} are not allowed" if bad
                  else "it must start and end with a letter or digit and not contain '..'")
        raise InvalidAnchor(
            f"anchor {shown!r} is invalid: {detail}; use lowercase letters, digits, '.', '_' "
            "and '-' (e.g. 'alice-software-tokyo')"
        )
    return text


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    return arr.astype("<i8", copy=False)


def anchor_key(anchor: str, fingerprint_hash: str, scope: str | None = None) -> str:
    """The key of `anchor` for a model (and a scope, e.g. a tenant's salt): 64 hex digits."""
    h = blake3.blake3(_KEY_DOMAIN)
    h.update(normalize_anchor(anchor).encode())
    h.update(b"\0")
    h.update(fingerprint_hash.encode())
    h.update(_scope_bytes(scope))
    return h.hexdigest()


def token_key(tokens: Sequence[int] | np.ndarray, fingerprint_hash: str, scope: str | None = None) -> str:
    """The key of an anchorless prompt: the chain hash of its first `TOKEN_BLOCK` tokens."""
    arr = _token_bytes(tokens)
    if arr.size < TOKEN_BLOCK:
        raise ValueError(
            f"an anchorless entry needs at least {TOKEN_BLOCK} prompt tokens, found {arr.size}"
        )
    return PrefixHasher(arr, fingerprint_hash, scope).hash(TOKEN_BLOCK)


class PrefixHasher:
    """Chain hashes of a prompt's prefixes, computed once per `TOKEN_BLOCK` and memoized.

    ``hash(n)`` for several n costs one pass over the tokens, so a lookup can test every
    stored prefix length of a key against one request cheaply.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray, fingerprint_hash: str, scope: str | None = None) -> None:
        self.tokens = _token_bytes(tokens)
        self._chain = [blake3.blake3(_PREFIX_DOMAIN + fingerprint_hash.encode() + _scope_bytes(scope)).digest()]

    def __len__(self) -> int:
        return int(self.tokens.size)

    def _link(self, prev: bytes, block: np.ndarray) -> bytes:
        return blake3.blake3(prev + block.tobytes()).digest()

    def hash(self, n: int) -> str:
        """Hex hash of the first `n` tokens (`n` <= the number of tokens)."""
        if not 0 < n <= self.tokens.size:
            raise ValueError(f"prefix length {n} must lie in [1, {self.tokens.size}]")
        full = n // TOKEN_BLOCK
        while len(self._chain) <= full:
            i = len(self._chain) - 1
            self._chain.append(self._link(self._chain[i], self.tokens[i * TOKEN_BLOCK : (i + 1) * TOKEN_BLOCK]))
        digest = self._chain[full]
        if n % TOKEN_BLOCK:
            digest = self._link(digest, self.tokens[full * TOKEN_BLOCK : n])
        return blake3.blake3(digest + n.to_bytes(8, "little")).hexdigest()

    def boundaries(self, n: int) -> list[str]:
        """`hash(k * TOKEN_BLOCK)` for k = 1 .. n // TOKEN_BLOCK: what an entry of `n` tokens
        records so that a prompt sharing only its first whole blocks can find them (a chain
        hash: a prompt that matches boundary k matches every boundary before it)."""
        return [self.hash(k * TOKEN_BLOCK) for k in range(1, n // TOKEN_BLOCK + 1)]


def prefix_hash(tokens: Sequence[int] | np.ndarray, n: int, fingerprint_hash: str, scope: str | None = None) -> str:
    """Hash of the first `n` of `tokens` (see `PrefixHasher`)."""
    return PrefixHasher(tokens, fingerprint_hash, scope).hash(n)


#: 64 lowercase hex digits: a key, a prefix hash
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_key(key: str) -> str:
    """A key as the store accepts it in a path: exactly 64 lowercase hex digits."""
    if not isinstance(key, str) or not HEX64.match(key):
        raise ValueError(f"a store key is 64 lowercase hex digits, found {key!r}")
    return key
