"""The fuzz suite, bounded for CI: every surface of a real cluster and the loaders get hostile inputs
(hypothesis), and none may crash a process, hang, answer with a server error or leak descriptors.
`python tools/fuzz.py --json` runs the same with 10,000 inputs per surface (docs/reliability.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import fuzz  # noqa: E402

pytestmark = pytest.mark.timeout(900)
INPUTS_PER_SURFACE = 60


@pytest.fixture(scope="module")
def targets(tiny_model_factory, tmp_path_factory):
    _, folder = tiny_model_factory("llama")
    t = fuzz.start_cluster(folder, tmp_path_factory.mktemp("fuzz-logs"))
    try:
        yield t
    finally:
        t.cluster.stop()


@pytest.mark.parametrize("surface", fuzz.SURFACES)
def test_hostile_inputs_do_no_harm(targets, surface):
    report = fuzz.run_surfaces(targets, INPUTS_PER_SURFACE, seed=20261201, surfaces=(surface,))
    print(json.dumps({k: v for k, v in report.items() if k != "surfaces"}))
    mine = report["surfaces"][surface]
    assert mine["inputs"] >= INPUTS_PER_SURFACE // 2, mine  # hypothesis drew inputs, and they were sent
    assert (report["crashes"], report["hangs"], report["server_errors"]) == (0, 0, 0), mine["samples"]
    assert report["fd_growth"] == 0, report["fd_growth_by_process"]
