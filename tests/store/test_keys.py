import numpy as np
import pytest

from anchorkv.store import InvalidAnchor, anchor_key, normalize_anchor, prefix_hash, token_key
from anchorkv.store.keys import ANCHOR_MAX_LEN, TOKEN_BLOCK, PrefixHasher, check_key

FP = "f" * 64


@pytest.mark.parametrize(
    "given",
    ["alice-software-tokyo", "<alice-software-tokyo/>", "  Alice-Software-Tokyo ", "<  ALICE-software-tokyo  />",
     "alice software   tokyo", "\talice-software-tokyo\n"],
)
def test_normalize_accepts_spellings(given):
    assert normalize_anchor(given) == "alice-software-tokyo"


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "<//>", "../x", "..", "a/../b", "/etc/passwd", "a/b", "a\x00b", "a\\b", "-lead", "trail-",
     "a..b", "x" * (ANCHOR_MAX_LEN + 1), "y" * 100_000, "naïve", "<a/><b/>", "a:b", "~root", ".hidden"],
)
def test_normalize_rejects(bad):
    with pytest.raises(InvalidAnchor, match="anchor"):
        normalize_anchor(bad)


def test_invalid_anchor_is_a_value_error():
    with pytest.raises(ValueError):
        normalize_anchor("../x")


def test_longest_allowed_anchor():
    assert normalize_anchor("a" * ANCHOR_MAX_LEN) == "a" * ANCHOR_MAX_LEN


def test_keys_are_hex_and_depend_on_anchor_and_fingerprint():
    k = anchor_key("<Alice-Software-Tokyo/>", FP)
    assert check_key(k) == k
    assert k == anchor_key("alice-software-tokyo", FP)
    assert k != anchor_key("alice-software-kyoto", FP)
    assert k != anchor_key("alice-software-tokyo", "e" * 64)


@pytest.mark.parametrize("bad", ["../" + "a" * 61, "A" * 64, "a" * 63, "/" * 64, "a" * 63 + "\x00"])
def test_check_key_rejects(bad):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        check_key(bad)


def test_token_key_is_first_block_only():
    t = np.arange(3 * TOKEN_BLOCK)
    u = t.copy()
    u[-1] += 1
    assert token_key(t, FP) == token_key(u, FP)
    u[0] += 1
    assert token_key(t, FP) != token_key(u, FP)
    with pytest.raises(ValueError, match="at least"):
        token_key(t[: TOKEN_BLOCK - 1], FP)


@pytest.mark.parametrize("n", [1, 5, TOKEN_BLOCK - 1, TOKEN_BLOCK, TOKEN_BLOCK + 1, 3 * TOKEN_BLOCK - 3])
def test_prefix_hash_sees_only_the_prefix(n):
    t = np.arange(3 * TOKEN_BLOCK) * 3
    h = PrefixHasher(t, FP)
    assert h.hash(n) == prefix_hash(t[:n], n, FP) == prefix_hash(list(t), n, FP)
    u = t.copy()
    u[n:] += 1
    assert PrefixHasher(u, FP).hash(n) == h.hash(n)
    u[n - 1] += 1
    assert PrefixHasher(u, FP).hash(n) != h.hash(n)
    assert h.hash(n) != h.hash(n + 1)


def test_prefix_hash_depends_on_fingerprint():
    t = np.arange(10)
    assert prefix_hash(t, 10, FP) != prefix_hash(t, 10, "e" * 64)
