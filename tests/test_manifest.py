"""Manifest validation: every committed YAML, and one test per broken-input case."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from cli import manifest_cmd
from mlscope.errors import ManifestError
from mlscope.framework_manifest import FrameworkManifest
from mlscope.manifest import ModelManifest, SystemManifest, mark_untrusted
from mlscope.manifest_files import iter_manifest_files, load_manifest
from mlscope.scenario_file import ScenarioFile
from mlscope.settings import Settings
from tests.zoo_fixtures import MANIFESTS

GOOD = """\
kind: model
name: tiny
version: 1.0.0
task: image_classification
framework:
  name: onnxruntime
  version: ">=1.12.0 <2.0"
inputs:
  - shape: [1, 8, 8]
    steps:
      - normalize: {rescale: 0.0625}
outputs:
  - steps: [{softmax: {}}]
assets:
  graph_path: tiny.onnx
  sha256: abababababababababababababababababababababababababababababababab
"""


def write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return info.value


ALL_YAML = iter_manifest_files([MANIFESTS])


def test_manifests_dir_is_not_empty() -> None:
    kinds = {type(load_manifest(p)) for p in ALL_YAML}
    assert {ModelManifest, FrameworkManifest, ScenarioFile, SystemManifest} <= kinds


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_committed_manifest_validates(path: Path) -> None:
    load_manifest(path)


def test_good_manifest_and_both_constraint_spellings(tmp_path: Path) -> None:
    m = load_manifest(write(tmp_path, GOOD))
    assert isinstance(m, ModelManifest) and m.trusted
    comma = load_manifest(write(tmp_path, GOOD.replace(">=1.12.0 <2.0", ">=1.12,<2"), "c.yaml"))
    assert isinstance(comma, ModelManifest)
    assert not mark_untrusted(m).trusted and m.trusted


def test_missing_field_names_file_line_field(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("  sha256: " + "ab" * 32 + "\n", ""))
    err = error_of(path)
    assert err.field == "assets.sha256" and err.file == str(path)
    assert err.line == 14  # the `assets:` key that lacks it
    assert "is required" in str(err) and f"{path}:14" in str(err)


def test_missing_top_level_field(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, GOOD.replace("task: image_classification\n", "")))
    assert err.field == "task" and err.line == 1


def test_wrong_type_names_nested_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, GOOD.replace("shape: [1, 8, 8]", "shape: [1, x, 8]")))
    assert err.field == "inputs.0.shape.1" and err.line == 9
    assert "valid integer" in str(err)


def test_wrong_type_scalar(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, GOOD.replace("version: 1.0.0", "version: 1.0")))
    assert err.field == "version" and err.line == 3


def test_unknown_field_nested(tmp_path: Path) -> None:
    text = GOOD.replace("  graph_path: tiny.onnx\n", "  graph_path: tiny.onnx\n  graf: x\n")
    err = error_of(write(tmp_path, text))
    assert err.field == "assets.graf" and err.line == 16
    assert "not a known field" in str(err)


def test_unknown_field_in_list_item(tmp_path: Path) -> None:
    text = GOOD.replace("  - steps: [{softmax: {}}]", "  - steps: [{softmax: {}}]\n    colour: red")
    err = error_of(write(tmp_path, text))
    assert err.field == "outputs.0.colour" and err.line == 14


def test_bad_version_constraint(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, GOOD.replace(">=1.12.0 <2.0", ">=1.12 <<2")))
    assert err.field == "framework.version" and err.line == 7
    assert "invalid version constraint" in str(err)


@pytest.mark.parametrize("bad", ["../outside.onnx", "models/../../x.onnx", "/etc/passwd"])
def test_graph_path_escaping_the_store(tmp_path: Path, bad: str) -> None:
    err = error_of(write(tmp_path, GOOD.replace("graph_path: tiny.onnx", f"graph_path: {bad}")))
    assert err.field == "assets.graph_path" and err.line == 15
    assert "relative" in str(err) or "'..'" in str(err)


def test_dataset_path_escaping(tmp_path: Path) -> None:
    text = GOOD + "dataset: {name: d, path: ../d.npz, sha256: " + "cd" * 32 + "}\n"
    err = error_of(write(tmp_path, text))
    assert err.field == "dataset.path"


def test_every_problem_is_listed(tmp_path: Path) -> None:
    text = GOOD.replace("task: image_classification\n", "").replace("version: 1.0.0", "version: x")
    err = error_of(write(tmp_path, text))
    assert "field 'task'" in str(err) and "field 'version'" in str(err)


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, GOOD.replace("task: image_classification", "task: [oops")))
    assert err.line is not None and err.file is not None


def test_framework_manifest(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        kind: framework
        name: onnxruntime
        version: 1.31.1
        containers:
          amd64: {cpu: mlscope/ort:1.31.1, gpu: mlscope/ort:1.31.1-cuda}
        options: {intra_op_threads: 2, providers: [CPUExecutionProvider]}
        """,
    )
    m = load_manifest(path)
    assert isinstance(m, FrameworkManifest) and m.options.intra_op_threads == 2
    bad = write(tmp_path, path.read_text().replace("cpu:", "tpu:"), "bad.yaml")
    assert error_of(bad).field is not None and error_of(bad).line == 5


def test_scenario_file(tmp_path: Path) -> None:
    ok = load_manifest(write(tmp_path, "kind: scenario\nname: online\nqps: 50\nduration_s: 10\n"))
    assert isinstance(ok, ScenarioFile) and ok.qps == 50
    err = error_of(write(tmp_path, "kind: scenario\nname: online\nduration_s: 10\n", "s.yaml"))
    assert "needs qps" in str(err)
    err = error_of(write(tmp_path, "kind: scenario\nname: burst\nqps: 5\n", "b.yaml"))
    assert err.field == "name" and err.line == 2
    text = "kind: scenario\nname: batched\nbatch_sizes: [1, 0]\n"
    err = error_of(write(tmp_path, text, "z.yaml"))
    assert err.field == "batch_sizes"
    text = "kind: scenario\nname: replay\nschedule_file: /t.csv\n"
    err = error_of(write(tmp_path, text, "r.yaml"))
    assert err.field == "schedule_file"


def test_cold_start_scenario_as_yaml() -> None:
    """The committed cold-start YAML validates and becomes the broker's scenario spec."""
    from broker.scenarios import scenario_spec

    path = MANIFESTS / "scenarios" / "cold-start.yaml"
    doc = load_manifest(path)
    assert isinstance(doc, ScenarioFile) and doc.name == "cold-start"
    spec = scenario_spec(path, {"repetitions": None, "warm_queries": 7})
    assert (spec.name, spec.repetitions, spec.warm_queries) == ("cold-start", 5, 7)


def test_cli_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    manifest_cmd.register(parser.add_subparsers())
    good = write(tmp_path, GOOD, "good.yaml")
    bad = write(tmp_path, GOOD.replace("task: image_classification\n", ""), "bad.yaml")
    args = parser.parse_args(["manifest", "validate", str(good)])
    args.settings = Settings()
    assert args.func(args) == 0
    args = parser.parse_args(["manifest", "validate", str(good), str(bad)])
    args.settings = Settings()
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1: field 'task': is required" in err


def test_cli_validate_names_a_directory_without_manifests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory that holds no manifest fails with its name said, never in silence."""
    parser = argparse.ArgumentParser()
    manifest_cmd.register(parser.add_subparsers())
    empty = tmp_path / "empty"
    empty.mkdir()
    args = parser.parse_args(["manifest", "validate", str(empty)])
    args.settings = Settings()
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert f"{empty}: no manifest files" in err
    assert "of 0 manifest(s)" not in err
