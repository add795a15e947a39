"""The two CUDA calls a set call's item tables need each call, made on the driver directly.

A `PackSet.pack` or `UnpackSet.unpack` call on a GPU stages its item table (`batch.TableRing`):
one copy of a few hundred bytes from a page-locked buffer into a device buffer, both kept by
the ring, and one event recorded after the launch. Through torch the copy is `Tensor.copy_`
(the dispatcher, device guards, the caching host allocator's lookup of the page-locked buffer
and an event it records for it): 3.8-6.7 us of host time on an H200 host, where set calls
issued back to back are bound by the host (stop 41's trace: ~55 us a call, the pack kernel
43.5 us). The ring needs neither the checks nor the host allocator's bookkeeping: it owns its
buffers and guards their reuse with its own events. So, where `libcuda` loads, the copy is one
`cuMemcpyHtoDAsync` (2.4-3.6 us, ctypes included) and the record one `cuEventRecord` (as
torch's, ~0.9-1.4 us), on the raw stream handle the launch goes to (`launch.launch_site()`,
what triton's launcher passes): the same stream-ordered, asynchronous operations torch would
issue, in the same context (the device's primary context, current on the calling thread: the
call has just allocated its output through torch, and triton's launcher relies on it alike).
Stop 42's H200 runs (`benchmarks.set_calls`, `benchmarks.launch_variants`): calls back to back
0.8-6.7 us faster a call (the host's speed varied between the runs).

A call the driver refuses queued nothing: it goes through torch. No current context on the
calling thread (a thread that has made no CUDA call yet) is refused for that call only; any
other error turns the driver path off for the process (one warning). Off with
`ANCHORKV_CUDA_DRIVER=0`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

#: Driver calls made since the process started (tests, profiles: a GPU test asserts that the
#: path it means is the one taken).
counts = {"copy": 0, "record": 0}

#: CUDA_ERROR_INVALID_CONTEXT: no context current on the calling thread (torch makes the
#: device's primary context current at the thread's first CUDA call)
NO_CONTEXT = 201


class Driver:
    """`copy(dst, src, nbytes, stream)` and `record(event, stream)` on `lib` (libcuda, or a
    test's stand-in with `cuMemcpyHtoDAsync_v2` and `cuEventRecord`): True when the driver
    returned success, False (nothing queued) when it refused (`_off`)."""

    def __init__(self, lib) -> None:
        self._copy = lib.cuMemcpyHtoDAsync_v2
        self._record = lib.cuEventRecord
        if isinstance(lib, ctypes.CDLL):  # (a stand-in takes Python ints as they are)
            self._copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            self._copy.restype = ctypes.c_int
            self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self._record.restype = ctypes.c_int
        self.on = True

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> bool:
        """`nbytes` from page-locked host address `src` to device address `dst`, queued on the
        stream of raw handle `stream`."""
        return self._call("copy", "cuMemcpyHtoDAsync", self._copy(dst, src, nbytes, stream))

    def record(self, event: int, stream: int) -> bool:
        """Record the CUDA event of handle `event` on the stream of raw handle `stream`."""
        return self._call("record", "cuEventRecord", self._record(event, stream))

    def _call(self, what: str, call: str, err: int) -> bool:
        """The outcome of a driver `call` that returned `err` (counted under `what`)."""
        if err:
            self._off(call, err)
            return False
        counts[what] += 1
        return True

    def _off(self, call: str, err: int) -> None:
        if err == NO_CONTEXT:  # (this thread's first CUDA work goes through torch, which makes one current)
            log.debug("anchorkv: %s found no current CUDA context; this call goes through torch", call)
            return
        self.on = False
        log.warning("anchorkv: %s returned CUDA error %d; item tables are staged through torch from now on "
                    "(set ANCHORKV_CUDA_DRIVER=0 to skip the attempt)", call, err)


def enabled() -> bool:
    """Whether the driver path may be used (`ANCHORKV_CUDA_DRIVER`, read when a ring is made)."""
    return os.environ.get("ANCHORKV_CUDA_DRIVER", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _loaded() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as e:  # no driver library (or not these symbols): torch's path
        log.info("anchorkv: libcuda not loaded (%s); item tables are staged through torch", e)
        return None


def driver() -> Driver | None:
    """The process's driver calls, or None (disabled, no libcuda, or turned off by an error)."""
    if not enabled():
        return None
    d = _loaded()
    return d if d is not None and d.on else None
