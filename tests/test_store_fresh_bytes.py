"""store/fresh_bytes.py: a get's answer lands in the bytes object it returns. The object must be an
ordinary bytes object once filled (equal, hashable, sliceable, kept alive by its holders alone)."""

from __future__ import annotations

import gc
import os
import sys

import pytest

from mooncaked.store import fresh_bytes



def test_it_is_used_on_cpython_the_interpreter_we_run_on() -> None:
    assert fresh_bytes.supported() == (sys.implementation.name == "cpython")


@pytest.mark.parametrize("size", [1, 7, 4096, 512 * 1024 + 3])
def test_a_filled_fresh_object_is_an_ordinary_bytes_object(size: int) -> None:
    src = os.urandom(size)
    out, view = fresh_bytes.fresh(size)
    assert type(out) is bytes and len(out) == size and view.nbytes == size and not view.readonly
    view[:] = src
    del view
    gc.collect()
    assert out == src and hash(out) == hash(bytes(src)) and out[1:] == src[1:]
    assert {out: 1}[src] == 1
    assert out + b"!" == src + b"!"


def test_writes_land_in_place_and_each_object_is_its_own() -> None:
    a, va = fresh_bytes.fresh(64)
    b, vb = fresh_bytes.fresh(64)
    va[:] = bytes(range(64))
    vb[:] = bytes(64)
    va[10:12] = b"xy"
    assert a[10:12] == b"xy" and a[:10] == bytes(range(10)) and b == bytes(64)


@pytest.mark.parametrize("size", [0, -1])
def test_a_size_that_is_not_positive_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="positive size"):
        fresh_bytes.fresh(size)
