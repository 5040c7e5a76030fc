"""``mlscope models init FILE``: a starter manifest from a real ONNX or TFLite file of
the test zoo, its names, shapes and element types checked against what the real
runtime reports, accepted by ``mlscope manifest validate``; and ``validate`` refusing
an element type numpy does not know."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


def mlscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def runtime_inputs(path: Path) -> list[tuple[str, list[int], str]]:
    """(name, per-sample shape, numpy dtype name) of each input, by the real runtime."""
    if path.suffix == ".onnx":
        import onnxruntime as ort

        kinds = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(uint8)": "uint8"}
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return [(i.name, list(i.shape[1:]), kinds[i.type]) for i in session.get_inputs()]
    from ai_edge_litert.interpreter import Interpreter

    details = Interpreter(model_path=str(path)).get_input_details()
    return [
        (d["name"], [int(x) for x in d["shape"][1:]], np.dtype(d["dtype"]).name) for d in details
    ]


@pytest.mark.parametrize(
    ("file", "framework"), [("digits_cnn.onnx", "onnxruntime"), ("digits_cnn.tflite", "tflite")]
)
def test_init_writes_a_manifest_that_validates(
    zoo_dir: Path, tmp_path: Path, file: str, framework: str
) -> None:
    model = tmp_path / file
    shutil.copy(zoo_dir / "digits_cnn" / "1.0.0" / file, model)
    done = mlscope("models", "init", str(model), "--name", "my_digits")
    assert done.returncode == 0, done.stderr
    out = tmp_path / f"digits_cnn.{framework}.yaml"
    doc = yaml.safe_load(out.read_text())
    assert doc["name"] == "my_digits" and doc["framework"]["name"] == framework
    assert doc["assets"]["graph_path"] == file
    assert doc["assets"]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    got = [(i["layer_name"], i["shape"], i["element_type"]) for i in doc["inputs"]]
    assert got == runtime_inputs(model)
    assert doc["outputs"] and all(o["layer_name"] for o in doc["outputs"])
    valid = mlscope("manifest", "validate", str(out))
    assert valid.returncode == 0, valid.stderr
    again = mlscope("models", "init", str(model))  # never overwrites silently
    assert again.returncode == 1 and "--force" in again.stderr


def test_init_elsewhere_points_at_the_file(zoo_dir: Path, tmp_path: Path) -> None:
    model = zoo_dir / "digits_cnn" / "1.0.0" / "digits_cnn.onnx"
    out = tmp_path / "m.yaml"
    assert mlscope("models", "init", str(model), "-o", str(out)).returncode == 0
    assets = yaml.safe_load(out.read_text())["assets"]
    assert assets["base_url"].startswith("file://") and assets["graph_path"] == "digits_cnn.onnx"
    assert mlscope("manifest", "validate", str(out)).returncode == 0


def test_init_refuses_an_unknown_file_type(tmp_path: Path) -> None:
    other = tmp_path / "model.pt"
    other.write_bytes(b"\0")
    done = mlscope("models", "init", str(other))
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and ".onnx" in done.stderr


def test_validate_refuses_an_unknown_element_type(tmp_path: Path) -> None:
    good = (REPO / "manifests/models/light_squeezenet.onnxruntime.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.replace("element_type: float32", "element_type: flaot32"))
    done = mlscope("manifest", "validate", str(bad))
    assert done.returncode == 1
    assert "unknown element_type 'flaot32'" in done.stderr and "Traceback" not in done.stderr
