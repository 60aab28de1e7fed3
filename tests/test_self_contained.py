"""A user's clone holds only the repository: nothing in it may read a path beside the checkout.

The second test copies the tree into an empty directory (nothing beside it) and runs the tests
that read bundled data there: the trace replay against a live `--role all` and the simulator.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a path outside the checkout looks like in our sources (this file, which spells them, is not checked)
OUTSIDE = re.compile(r"\.\./" + "shar" + r"ed|parents?\b[^\n]*[\"']shared[\"']|/" + "shar" + "ed/data")


def _tree_files() -> list[Path]:
    """The files a clone would have: tracked ones and new ones git does not ignore."""
    if not (ROOT / ".git").exists():
        pytest.fail(f"{ROOT} is not a git checkout; this test lists files through git")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def test_no_source_names_a_path_beside_the_checkout():
    hits = []
    for path in _tree_files():
        if path.suffix not in {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ""} or path == Path(__file__):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                 if OUTSIDE.search(line)]
    assert not hits, "these read outside the checkout:\n" + "\n".join(hits)


@pytest.mark.timeout(300)
def test_the_data_tests_pass_in_a_copy_with_nothing_beside_it(tmp_path):
    clone = tmp_path / "empty" / "mooncaked"
    for path in _tree_files():
        dest = clone / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    assert sorted(p.name for p in clone.parent.iterdir()) == ["mooncaked"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOONCAKED_", "PYTEST_"))}
    # the copy's own package, not the checkout's: cwd leads sys.path for `python -m`
    env["PYTHONPATH"] = str(clone)
    tests = ["tests/test_replay.py::test_replay_a_slice_of_the_trace",
             "tests/test_simulate.py::test_every_policy_runs_and_the_json_has_the_schema"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-2000:]
    # and it ran the copy's code
    probe = subprocess.run([sys.executable, "-c", "import mooncaked; print(mooncaked.__file__)"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=60)
    assert Path(probe.stdout.strip()).is_relative_to(clone), probe.stdout + probe.stderr
