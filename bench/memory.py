"""Peak extra resident memory of one call, from the kernel's high-water mark.

How it works (Linux only):

1. At start-up, glibc's malloc is told (``mallopt``) to serve every block of 128 KiB or
   more with its own ``mmap`` and to give it back on ``free``, and the dynamic threshold
   adjustment is switched off by that same call. torch's CPU allocator does not cache, so
   a freed tensor's pages leave the process at once and the resident set follows the
   live tensors.
2. Before a call: ``gc.collect()``, ``malloc_trim(0)``, read ``VmRSS``, then write ``5``
   to ``/proc/self/clear_refs``, which resets the peak ``VmHWM`` to the current RSS.
3. Call the function, keeping its result alive; read ``VmHWM``.

peak = VmHWM - VmRSS_before: everything the call made resident at its worst moment,
temporaries *and* outputs, torch or not. Granularity is a page; blocks under 128 KiB
come from malloc arenas that may reuse freed space, so values under ~0.2 MiB are noise
(the small helper cases). Views of inputs cost nothing, as they should.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any, Callable

_LIBC = None
_OK = None


def setup() -> bool:
    """Configure malloc and check that the kernel lets us reset the peak; True if usable."""
    global _LIBC, _OK
    if _OK is not None:
        return _OK
    try:
        _LIBC = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        _LIBC.mallopt(m_mmap_threshold, 128 * 1024)
        _LIBC.mallopt(m_trim_threshold, 128 * 1024)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status("VmHWM")
        _OK = True
    except Exception:  # noqa: BLE001 - not Linux/glibc: no memory column
        _OK = False
    return _OK


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak extra RSS (bytes) during ``fn()``, its result included; None if unsupported."""
    if not setup():
        return None
    gc.collect()
    _LIBC.malloc_trim(0)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = fn()
    peak = _status("VmHWM")
    del result
    gc.collect()
    return max(0, peak - before)
