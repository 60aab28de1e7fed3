"""Our native kernels for the tests: the module, or a skip only where this CPU cannot run them."""

from __future__ import annotations

import pytest


def native_or_skip():
    """The built native module (engine/native.py). Skips only where the CPU cannot run it (not x86-64, no
    AVX-512); a CPU that can run it but fails to build it fails the test. The suite runs with the user's
    switch (MOONCAKED_NATIVE) cleared: conftest.py."""
    from mooncaked.engine.native import cpu_cannot_run, native_module

    reason = cpu_cannot_run()
    if reason is not None:
        pytest.skip(f"native kernels: {reason}")
    module = native_module()
    assert module is not None, "the native kernels failed to build on a CPU that can run them (see the log)"
    return module
