"""``mlscope models init FILE``: a starter manifest from a real ONNX or TFLite file of
the test zoo, its names, shapes and element types checked against what the real
runtime reports, accepted by ``mlscope manifest validate``; and ``validate`` refusing
an element type numpy does not know."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# ---- what init writes, and where: small ONNX files made here, the command run in process


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No bus, a data directory of its own, no extra manifests directory."""
    monkeypatch.setenv("MLSCOPE_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("MLSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("MLSCOPE_MANIFESTS", raising=False)
    return tmp_path


def onnx_file(
    path: Path, dims: list[int], *, elem: int = 1, inputs: int = 1, name: str = "x"
) -> Path:
    """An ONNX graph with no nodes: only its declared inputs and one output matter here."""
    import onnx
    from onnx import helper

    xs = [helper.make_tensor_value_info(f"{name}{i}", elem, dims) for i in range(inputs)]
    y = helper.make_tensor_value_info("y", 1, [1])
    onnx.save(helper.make_model(helper.make_graph([], "g", xs, [y])), str(path))
    return path


def init(*args: str) -> int:
    from cli.main import main

    return main(["models", "init", *args])


def manifests_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".yaml" in p.name)


INVALID_MODELS: dict[str, dict[str, Any]] = {
    "dims_below_one": {"dims": [1, -1, 0]},
    "negative_batch": {"dims": [-5, 3]},
    "empty_batch": {"dims": [0, 3]},
    "bfloat16": {"dims": [1, 3], "elem": 16},
    "strings": {"dims": [1, 3], "elem": 8},
    "forty_dims": {"dims": [1] * 40},
    "two_thousand_inputs": {"dims": [1, 3], "inputs": 2000},
    "over_the_manifest_size_limit": {"dims": [1, 3], "inputs": 1000, "name": "x" * 1100},
}


@pytest.mark.parametrize("case", sorted(INVALID_MODELS))
def test_init_of_a_model_no_manifest_can_describe_writes_nothing(
    isolated: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = onnx_file(isolated / "m.onnx", **INVALID_MODELS[case])
    assert init(str(model)) == 1
    assert manifests_in(isolated) == []
    first = capsys.readouterr().err
    assert init(str(model)) == 1  # the retry meets the same refusal, not "exists"
    assert capsys.readouterr().err == first and "exists" not in first


@pytest.mark.parametrize(
    "flags", [["--name", "bad name"], ["--version", "1" * 100], ["--version", "not a version"]]
)
def test_a_refused_name_or_version_is_a_usage_error(
    isolated: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    model = onnx_file(isolated / "m.onnx", [1, 3])
    assert init(str(model), *flags) == 2
    assert f"argument {flags[0]}:" in capsys.readouterr().err
    assert manifests_in(isolated) == []


def test_init_never_writes_through_a_symlink(isolated: Path) -> None:
    model = onnx_file(isolated / "ok.onnx", [1, 3])
    target = isolated / "elsewhere" / "planted"
    target.parent.mkdir()
    out = isolated / "out.yaml"
    out.symlink_to(target)  # dangling: out.exists() is False
    assert init(str(model), "-o", str(out)) == 1
    assert out.is_symlink() and not target.exists()
    assert init(str(model), "-o", str(out), "--force") == 0  # replaces the link itself
    assert not out.is_symlink() and "kind: model" in out.read_text()
    assert not target.exists()


def test_init_of_a_symlinked_model_names_the_file_it_points_at(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = isolated / "store" / "resnet_v3_final.onnx"
    real.parent.mkdir()
    onnx_file(real, [1, 3])
    models = isolated / "models"
    models.mkdir()
    (models / "resnet.onnx").symlink_to(real)
    assert init(str(models / "resnet.onnx")) == 0
    assets = yaml.safe_load((models / "resnet.onnxruntime.yaml").read_text())["assets"]
    assert assets["graph_path"] == real.name and assets["base_url"].endswith("/store")
    from cli.main import main

    monkeypatch.setenv("MLSCOPE_MANIFESTS", str(models))
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = [r for rs in json.loads(capsys.readouterr().out).values() for r in rs]
    row = next(r for r in rows if r["name"] == "resnet")
    assert row["available"] and row["path"] == str(real)


def test_models_says_why_a_missing_file_model_is_missing(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``file://`` model whose file is gone has no command that fixes it: the listing
    says what is missing instead of advising to run ``None``."""
    from cli.main import main

    model = onnx_file(isolated / "gone.onnx", [1, 3])
    (isolated / "manifests").mkdir()
    assert init(str(model), "-o", str(isolated / "manifests" / "gone.yaml")) == 0
    model.unlink()
    monkeypatch.setenv("MLSCOPE_MANIFESTS", str(isolated / "manifests"))
    capsys.readouterr()
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "run `None`" not in out
    assert "gone.onnx" in out and "missing:" in out


def test_init_says_a_directory_is_no_file(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory given as the model or as ``-o`` is named as one, refused before any
    work (``--force`` replaces a file or a link, never a directory), and nothing written."""
    (isolated / "dir.onnx").mkdir()
    assert init(str(isolated / "dir.onnx")) == 1
    assert "not a regular file (a directory)" in capsys.readouterr().err
    model = onnx_file(isolated / "m.onnx", [1, 3])
    out = isolated / "out.yaml"
    (out / "inside").mkdir(parents=True)
    for force in ([], ["--force"]):
        assert init(str(model), "-o", str(out), *force) == 1
        err = capsys.readouterr().err
        assert f"{out} is a directory" in err and ".tmp" not in err, err
    assert manifests_in(isolated) == ["out.yaml"] and out.is_dir()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["fifo", "latin1"])
def test_a_labels_file_that_is_no_text_file_is_an_artifact_error(isolated: Path, kind: str) -> None:
    """The agent drops labels on an MLScopeError; a Latin-1 byte escaped as a
    UnicodeDecodeError and a FIFO hung the model's load."""
    from mlscope.catalog import Entry
    from mlscope.errors import ArtifactError
    from mlscope.manifest import ModelManifest
    from mlscope.manifest_files import load_manifest

    assert init(str(onnx_file(isolated / "m.onnx", [1, 3]))) == 0
    doc = yaml.safe_load((isolated / "m.onnxruntime.yaml").read_text())
    doc["outputs"][0]["labels"] = "labels.txt"
    (isolated / "m.onnxruntime.yaml").write_text(yaml.safe_dump(doc))
    if kind == "fifo":
        os.mkfifo(isolated / "labels.txt")
    elif kind == "latin1":
        (isolated / "labels.txt").write_bytes(b"caf\xe9\n")
    manifest = load_manifest(isolated / "m.onnxruntime.yaml")
    assert isinstance(manifest, ModelManifest)
    entry = Entry(manifest=manifest, path=isolated / "m")
    with pytest.raises(ArtifactError, match="cannot read labels"):
        entry.labels(isolated / "zoo")
