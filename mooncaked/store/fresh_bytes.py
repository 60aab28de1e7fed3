"""A new `bytes` object to receive into, so a get's answer lands in the object it returns.

A get hands the caller `bytes`. Receiving into a buffer and then copying out costs one more pass
over the object (~10 µs for 512 KiB here, docs/performance.md "KV pool"). CPython's own
`socket.recv(n)` avoids that pass: it makes the object with `PyBytes_FromStringAndSize(NULL, n)`
(the C API's documented way to make one to fill) and receives straight into it. A
`BufferedProtocol` cannot ask for that, so this makes the same object through the C API and gives
out a writable view of its storage.

The one rule: nobody may see the object until it is filled and checked. Its maker keeps it to
itself until then, and drops it on any failure. On an interpreter other than CPython,
`supported()` is False, and callers receive into a buffer of their own and copy out.
"""

from __future__ import annotations

import ctypes
import sys

_IS_CPYTHON = sys.implementation.name == "cpython"
# where a bytes object's storage starts: its fixed part, less the one byte of `ob_sval` it counts
_DATA_OFFSET = bytes.__basicsize__ - 1

if _IS_CPYTHON:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def supported() -> bool:
    return _IS_CPYTHON


def fresh(size: int) -> tuple[bytes, memoryview]:
    """A new bytes object of `size` bytes, its contents not yet set, and a writable view of them.
    The view does not keep the object alive: hold the object while writing through it."""
    if size <= 0:
        raise ValueError(f"need a positive size, not {size}")
    out = _new_bytes(None, size)
    view = memoryview((ctypes.c_char * size).from_address(id(out) + _DATA_OFFSET)).cast("B")
    return out, view
