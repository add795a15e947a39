"""The store's crc32c (`anchorkv.store.format.crc32c`): the three libraries it can use (fastcrc,
the `crc32c` package, google-crc32c) give the same integers for every buffer the store hands
them, a store saved with one verifies with another, and the checksum threads follow the library.

The test extra installs all three (fastcrc is a main dependency, the `crc32c` package is the
`fast-crc` extra): a missing one fails here, in CI as anywhere."""

import sys

import numpy as np
import pytest
import torch

from anchorkv.store import format as F
from anchorkv.store.format import crc32c
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

LIBS = ("fastcrc", "crc32c", "google-crc32c")
#: Sizes around every width the libraries switch at: 8/16/64-byte lanes, the 16 KiB (fastcrc)
#: and 32 KiB (`crc32c`) where the GIL is released, and a shard-sized buffer.
SIZES = (0, 1, 2, 7, 15, 16, 17, 63, 64, 65, 255, 4096, 16383, 16384, 16385, 32767, 32768, 32769,
         100_003, (1 << 20) + 3, 3 * (1 << 20) + 7)
_BYTES = np.random.default_rng(7).integers(0, 256, 3 * (1 << 20) + 64, dtype=np.uint8)


def _function(lib: str):
    """`lib`'s `fn(data, value)` as `format._CRC_FREE` holds it (None: google-crc32c)."""
    if lib == "fastcrc":
        from fastcrc import crc32

        return crc32.iscsi
    if lib == "crc32c":
        import crc32c as icrar

        return icrar.crc32c
    return None


@pytest.fixture(params=LIBS)
def crc_lib(request, monkeypatch):
    """`format.crc32c` computed by each library in turn."""
    monkeypatch.setattr(F, "_CRC_FREE", _function(request.param))
    monkeypatch.setattr(F, "CRC32C_LIB", request.param)
    return request.param


def test_fastcrc_is_the_default():
    """fastcrc is a main dependency, so a default install computes with it (and its checksum
    threads run beside the writes: see `test_checksum_threads_by_cores_and_library`)."""
    from fastcrc import crc32

    assert (F.CRC32C_LIB, F._CRC_FREE) == ("fastcrc", crc32.iscsi)


@pytest.mark.parametrize("missing,want", [(("fastcrc",), "crc32c"), (("fastcrc", "crc32c"), None)])
def test_the_fallbacks_when_fastcrc_is_missing(monkeypatch, missing, want):
    """A platform without a fastcrc wheel takes the `crc32c` package (where it uses the CPU's
    crc32 instruction), then google-crc32c."""
    import crc32c as icrar

    want = want if icrar.hardware_based else None
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    found = F._gil_free_crc32c()
    assert (found and found[0]) == want
    if want == "crc32c":
        assert found is not None and found[1] is icrar.crc32c


def test_crc32c_check_value(crc_lib):
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(memoryview(bytearray(b"56789")), value=crc32c(b"1234")) == 0xE3069283
    assert crc32c(b"") == 0 and crc32c(b"", value=0xE3069283) == 0xE3069283


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lib", ["fastcrc", "crc32c"])
def test_the_crc32c_libraries_agree(lib, n, offset):
    """Each size, from an aligned and an unaligned start (views into one buffer, no copy), as an
    ndarray, a memoryview and bytes: the same integer as google-crc32c, and continuations
    (`fn(b, fn(a)) == fn(a + b)`, google-crc32c's `extend`) agree at every cut and seed."""
    import google_crc32c

    fn = _function(lib)
    view = _BYTES[offset:offset + n]
    want = google_crc32c.value(view.tobytes())
    got = (fn(view, 0), fn(memoryview(view), 0), fn(view.tobytes(), 0), fn(memoryview(_BYTES)[offset:offset + n], 0))
    assert got == (want,) * 4, ([hex(g) for g in got], hex(want))
    for cut in sorted({0, 1, n // 3, n // 2, n - 1, n} & set(range(n + 1))):
        assert fn(view[cut:], fn(view[:cut], 0)) == want, cut
    seed = 0x9E3779B9 ^ n
    assert fn(view, seed) == google_crc32c.extend(seed, view.tobytes())


@pytest.mark.parametrize("n", [1, 17, 65, 16385, 100_003])
def test_format_crc32c_of_the_buffers_the_store_hands_it(crc_lib, n):
    """What the writer and the reader pass: numpy arrays of any dtype and shape (C-contiguous),
    uint8 views of torch tensors (bf16 latents), memoryview slices, a continuation over parts."""
    import google_crc32c

    raw = _BYTES[5:5 + 8 * n]
    want = google_crc32c.value(raw.tobytes())
    assert crc32c(raw) == want
    for dtype in ("<u2", "<i4", "<f4", "<f8"):
        assert crc32c(raw.view(dtype)) == want, dtype
    assert crc32c(raw.view("<f4").reshape(-1, 2)) == want
    bf16 = torch.from_numpy(raw.copy()).view(torch.bfloat16)
    assert crc32c(bf16.view(torch.uint8).numpy()) == want
    parts = [memoryview(raw)[i:i + 1000] for i in range(0, raw.nbytes, 1000)] or [memoryview(raw)]
    crc = 0
    for p in parts:
        crc = crc32c(p, value=crc)
    assert crc == want


@pytest.mark.parametrize("make", [lambda a: a[::2], lambda a: memoryview(a)[::2],
                                  lambda a: a[:1000].reshape(10, 100)[:, :50],
                                  lambda a: a[:1000].reshape(10, 100).T],
                         ids=["strided", "strided-memoryview", "2d-slice", "fortran"])
def test_non_contiguous_buffers_are_refused(crc_lib, make):
    """No library checksums a strided view as if it were its bytes (nor copies it silently):
    the store never hands one, and one that did would fail, not pass unchecked."""
    with pytest.raises((ValueError, BufferError, TypeError)):
        crc32c(make(_BYTES[:4000]))


def test_a_store_saved_with_any_crc32c_library_is_the_same(tmp_path, monkeypatch):
    """The manifest (every chunk's and shard's checksum) and the files are identical; each
    store verifies with the next library."""
    layout = tiny_layout()
    stores = {}
    for lib in LIBS:
        monkeypatch.setattr(F, "_CRC_FREE", _function(lib))
        store = Store.open(tmp_path / lib)
        info = store.save(layout, CODECS, tokens(300), all_packed(layout, CODECS, 300), anchor="a")
        stores[lib] = (store, info)
    infos = [info for _, info in stores.values()]
    for other in infos[1:]:
        assert other.manifest["checksums"] == infos[0].manifest["checksums"]
        assert other.manifest["shards"] == infos[0].manifest["shards"]
    for i, lib in enumerate(LIBS):  # each verified by another library
        monkeypatch.setattr(F, "_CRC_FREE", _function(LIBS[(i + 1) % len(LIBS)]))
        store, info = stores[lib]
        assert Store.open(store.backend.url, create=False).verify(info.id) == []


@pytest.mark.parametrize("cores,lib,want", [(1, "fastcrc", 1), (2, "fastcrc", 2), (16, "fastcrc", 2),
                                            (1, "crc32c", 1), (2, "crc32c", 2), (16, "crc32c", 2),
                                            (1, "google-crc32c", 1), (2, "google-crc32c", 1),
                                            (16, "google-crc32c", 2)])
def test_checksum_threads_by_cores_and_library(cores, lib, want):
    """The GIL-free libraries get a checksum thread beside the writes from 2 cores on."""
    from anchorkv.store.store import chunk_threads

    assert chunk_threads(cores, lib) == want


@pytest.mark.parametrize("n1,n2", [(0, 5), (5, 0), (1, 1), (1000, 77), (65536, 4097)])
def test_crc32c_combine(n1, n2):
    from anchorkv.store.format import crc32c_combine, crc32c_combine_fixed

    rng = np.random.default_rng(n1 * 100003 + n2)
    a, b = rng.bytes(n1), rng.bytes(n2)
    assert crc32c_combine(crc32c(a), crc32c(b), n2) == crc32c(a + b)
    assert crc32c_combine_fixed(crc32c(a), crc32c(b), n2) == crc32c(a + b)
