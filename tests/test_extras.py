"""The core install runs every command's --help and draws reports with their figures,
and a feature of an extra says in one line which extra to install.

Fast: a clean interpreter with every extra's modules blocked (``sys.modules[name] =
None``, as if not installed). Slow: a fresh virtualenv (no system site-packages) with
the core dependencies only, from the configured package index (about a minute here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlscope.errors import ArtifactError

REPO = Path(__file__).resolve().parent.parent

EXTRA_MODULES = (
    "matplotlib",
    "sklearn",
    "mlxtend",
    "skimage",
    "torch",
    "tensorflow",
    "onnx",
    "onnxruntime",
    "ai_edge_litert",
    "streamlit",
    "altair",
    "mlperf_loadgen",
    "pynvml",
)
"""Top-level modules that only the extras of pyproject.toml install."""

NOWHERE = "nats://127.0.0.1:9"
"""The bus these commands are pointed at: nothing listens there, whatever else runs on
this machine (a stack of `mlscope up` on the default port included)."""
NO_SERVER = f"mlscope report: no NATS server at {NOWHERE}"
"""What a core-only report says with nothing running: it got as far as the bus (no extra
was missing on the way)."""


_CORE_ONLY = textwrap.dedent(
    """
    import sys
    for name in sys.argv[1].split(","):
        sys.modules[name] = None  # not installed
    from cli.main import main
    raise SystemExit(main(sys.argv[2:]))
    """
)


def _core_only(*argv: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLSCOPE_DATA_DIR": str(data_dir),
        "MLSCOPE_NATS_URL": NOWHERE,
    }
    return subprocess.run(
        [sys.executable, "-c", _CORE_ONLY, ",".join(EXTRA_MODULES), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_report_help_needs_no_extra(tmp_path: Path) -> None:
    got = _core_only("report", "--help", data_dir=tmp_path)
    assert got.returncode == 0, got.stderr
    assert "usage: mlscope report" in got.stdout


def test_report_needs_no_extra(tmp_path: Path) -> None:
    got = _core_only("report", "0123abcd", data_dir=tmp_path)
    assert got.returncode == 1
    [line] = got.stderr.splitlines()
    assert line.startswith(NO_SERVER) and "pip install" not in line, line


@pytest.mark.slow
def test_core_only_install_in_a_fresh_venv(tmp_path: Path) -> None:
    """``pip install -e .`` with no extras, nothing inherited from this interpreter."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "-e", str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    mlscope = str(venv / "bin" / "mlscope")
    env = {**os.environ, "MLSCOPE_DATA_DIR": str(tmp_path / "data"), "MLSCOPE_NATS_URL": NOWHERE}
    env.pop("PYTHONPATH", None)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [mlscope, *argv], capture_output=True, text=True, env=env, timeout=120, check=False
        )

    help_ = run("report", "--help")
    assert help_.returncode == 0 and "usage: mlscope report" in help_.stdout, help_.stderr
    report = run("report", "0123abcd")
    assert report.returncode == 1
    [line] = report.stderr.strip().splitlines()
    assert line.startswith(NO_SERVER) and "pip install" not in line, line
    for command in ("agents", "models", "runs", "rerun", "zoo", "doctor"):
        assert run(command, "--help").returncode == 0, command


def test_a_zoo_build_without_its_packages_names_the_extras() -> None:
    from cli.zoo_cmd import _install_hint
    from mlscope.artifacts import resolve_package

    with pytest.raises(ArtifactError) as info:
        resolve_package("pkg://no_such_package_here/data")
    assert _install_hint(info.value).endswith("pip install 'mlscope[zoo,onnx,torch,tf,tflite]'")
    assert _install_hint(ArtifactError("a checksum differs")) == ""
