"""``mlscope demo``, the README's first command, end to end as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, make_data_dir, python

pytestmark = pytest.mark.timeout(300)


def test_the_demo_starts_the_stack_evaluates_digits_cnn_twice_and_stops(
    tmp_path: Path, zoo_dir: Path
) -> None:
    """Its own nats-server and chDB under a fresh data directory and home, the online
    and batched evaluations printed with their verdicts, every process stopped."""
    data = make_data_dir(tmp_path / "data", zoo_dir)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLSCOPE_") and k != "HOME"}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [python(), "-m", "cli.main", "demo", "--data-dir", str(data), "--duration", "2"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for scenario in ("online", "batched"):
        assert f"== digits_cnn on onnxruntime, {scenario} ==" in out, out
    verdicts = re.findall(r"\b(VALID|INVALID)\b", out)
    assert len(verdicts) >= 2, out
    online, batched = out.split("== digits_cnn on onnxruntime, batched ==")
    # The first evaluation loaded the model, the second found it loaded: neither
    # prints a figure it did not measure.
    assert re.search(r"cold start +load \d+\.\d+ ms  first inference \d+\.\d+ ms\n", online)
    assert "cold start    not measured: the model was already loaded (warm)" in batched
    assert "None" not in out, out
    assert not (home / ".mlscope").exists()  # the data directory given, nothing else
    left = subprocess.run(
        ["pgrep", "-f", str(data)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert left == [], f"processes still running on the demo's data directory: {left}"
