"""Hostile manifest files: each gives a clear ``file:line`` error within a second and
bounded memory, through the loader and through the CLI (`manifest validate`, `models
publish`), and the bus path refuses the same shapes in JSON."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from cli.main import main as mlscope_main
from mlscope import bounded, names
from mlscope.artifacts import zoo_coordinates
from mlscope.buildlock import LOCK_NAME, BuildLock
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.errors import ArtifactError, ManifestError
from mlscope.manifest import (
    MAX_SAMPLE_DIMS,
    MAX_SAMPLE_ELEMENTS,
    NAME_MAX_CHARS,
    VERSION_MAX_CHARS,
    ModelManifest,
)
from mlscope.manifest_files import load_manifest, parse_manifest
from mlscope.model_registry import _parse

pytestmark = pytest.mark.timeout(60)

BOMB = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    + ["kind: model", "name: bomb", "tags: *a8", ""]
)
"""The billion-laughs shape, under a kilobyte: 9^9 leaves once expanded."""


def _bomb(d: Path) -> Path:
    p = d / "bomb.yaml"
    p.write_text(BOMB)
    assert p.stat().st_size < 1024
    return p


def _huge(d: Path) -> Path:
    p = d / "huge.yaml"
    with p.open("wb") as fh:  # 100 MB, sparse: the limit must hold before reading
        fh.truncate(100 << 20)
    return p


def _not_utf8(d: Path) -> Path:
    p = d / "latin1.yaml"
    p.write_bytes(b"kind: model\nname: caf\xe9\n")
    return p


def _deep(d: Path) -> Path:
    p = d / "deep.yaml"
    p.write_text("kind: model\nx: " + "[" * 20_000 + "]" * 20_000 + "\n")
    return p


def _duplicate(d: Path) -> Path:
    p = d / "dup.yaml"
    p.write_text("kind: model\nname: a\nversion: 1.0.0\nname: b\n")
    return p


def _recursive(d: Path) -> Path:
    p = d / "loop.yaml"
    p.write_text("kind: model\nx: &a [1, *a]\n")
    return p


CASES: dict[str, tuple[Callable[[Path], Path], str, int | None]] = {
    "bomb": (_bomb, "expands to more than", 1),
    "huge": (_huge, "a manifest may have at most", None),
    "not-utf8": (_not_utf8, "column 10: byte 0xe9 is not UTF-8", 2),
    "deep": (_deep, "nested deeper than 64 levels", 2),
    "duplicate": (_duplicate, "duplicate key 'name' (first on line 2)", 4),
    "recursive": (_recursive, "refers to a collection that contains it", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_file_is_refused_quickly_with_its_line(tmp_path: Path, case: str) -> None:
    make, text, line = CASES[case]
    path = make(tmp_path)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ManifestError) as err:
            load_manifest(path)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0, elapsed
    assert peak < 64 << 20, peak
    assert text in err.value.message
    assert err.value.file == str(path) and err.value.line == line
    prefix = f"{path}:{line}: " if line else f"{path}: "
    assert str(err.value).startswith(prefix), str(err.value)


@pytest.mark.parametrize("command", [["manifest", "validate"], ["models", "publish"]])
@pytest.mark.parametrize("case", ["bomb", "deep", "not-utf8", "duplicate"])
def test_cli_reports_the_error_not_a_traceback(
    tmp_path: Path, case: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = CASES[case][0](tmp_path)
    t0 = time.perf_counter()
    code = mlscope_main([*command, str(path)])
    assert time.perf_counter() - t0 < 1.0
    err = capsys.readouterr().err
    assert code != 0
    assert CASES[case][1] in err and str(path) in err
    assert "Traceback" not in err


def test_well_formed_aliases_still_load(tmp_path: Path) -> None:
    p = tmp_path / "m.yaml"
    p.write_text(
        "base: &s {rescale: 0.5}\nkind: system\nname: box\narch: x86_64\nextra: [*s, *s]\n"
    )
    data, _ = bounded.load_yaml_bounded(p)
    assert data["extra"] == [{"rescale": 0.5}, {"rescale": 0.5}]


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"{" + b'"a": [' * 10_000 + b"]" * 10_000 + b"}", "nested deeper than"),
        (b'{"kind": "model", "kind": "model"}', "duplicate key 'kind'"),
        (b'{"name": "caf\xe9"}', "is not UTF-8"),
        (b" " * (bounded.MAX_DOCUMENT_BYTES + 1), "a manifest may have at most"),
    ],
)
def test_bus_values_are_bounded_too(raw: bytes, text: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ManifestError, match=text) as err:
        _parse("bad.1.onnxruntime", raw)
    assert time.perf_counter() - t0 < 1.0
    assert err.value.file == "mlscope_models/bad.1.onnxruntime"


def _tree(node: yaml.Node) -> object:
    """A composed node as plain data: tag, line and value, recursively."""
    line = int(node.start_mark.line)
    if isinstance(node, yaml.MappingNode):
        return (node.tag, line, [(_tree(k), _tree(v)) for k, v in node.value])
    if isinstance(node, yaml.SequenceNode):
        return (node.tag, line, [_tree(v) for v in node.value])
    return (node.tag, line, node.value)


def test_libyaml_parses_and_the_bounded_composer_composes_the_same_documents() -> None:
    """Where PyYAML has libyaml, its C parser feeds the bounded composer (a quarter of
    the pure-Python time on the catalog); every manifest of the repository composes to
    the same nodes, lines included, and the same data as through PyYAML's own parser."""
    if yaml.__with_libyaml__:
        from yaml._yaml import CParser

        assert CParser in bounded._BoundedLoader.__mro__

    class PurePython(bounded._BoundedComposer, yaml.SafeLoader):  # type: ignore[misc]
        pass

    paths = sorted(p for d in default_manifest_dirs() for p in d.rglob("*.yaml"))
    assert len(paths) > 20
    for path in paths:
        got = []
        for loader_type in (bounded._BoundedLoader, PurePython):
            loader = loader_type(path.read_text())
            try:
                node = loader.get_single_node()
                got.append((_tree(node), loader.construct_document(node)))
            finally:
                loader.dispose()
        assert got[0] == got[1], path


# ------------------------------------------------------------------ model manifests


def _model(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "kind": "model",
        "task": "platform_overhead",
        "name": "m",
        "version": "1.0.0",
        "framework": {"name": "noop", "version": "*"},
        "inputs": [{"shape": [16]}],
        "outputs": [{}],
        "assets": {"base_url": "zoo://m/1.0.0", "graph_path": "g.onnx"},
        "latency_only": True,
    }
    return {**doc, **changes}


@pytest.mark.parametrize(
    ("shape", "text"),
    [
        ([-5], "at least 1"),
        ([0, 3], "at least 1"),
        ([1] * (MAX_SAMPLE_DIMS + 1), f"at most {MAX_SAMPLE_DIMS} dimensions"),
        ([10**12], f"at most {MAX_SAMPLE_ELEMENTS} elements"),
        ([1 << 13, 1 << 13, 2], f"at most {MAX_SAMPLE_ELEMENTS} elements"),
    ],
)
def test_an_input_shape_is_bounded(shape: list[int], text: str) -> None:
    with pytest.raises(ManifestError, match=text) as err:
        parse_manifest(_model(inputs=[{"shape": shape}]), file="m.yaml")
    assert err.value.field == "inputs.0.shape"


@pytest.mark.parametrize(
    ("element_type", "fill"),
    [
        ("int64", float("nan")),
        ("int32", 1e300),
        ("int32", 2.5),
        ("uint8", -1.0),
        ("uint8", 256.0),
        ("bool", 2.0),
        ("float32", float("inf")),
        ("float16", 1e6),
    ],
)
def test_a_fill_is_a_value_of_its_inputs_type(element_type: str, fill: float) -> None:
    """A filled input's value is cast to its type: one the type cannot hold (NaN for an
    integer, a number past its range) became garbage with a warning on every query."""
    second = {"shape": [1], "element_type": element_type, "fill": fill}
    with pytest.raises(ManifestError, match=f"is no {element_type} value") as err:
        parse_manifest(_model(inputs=[{"shape": [3]}, second]), file="m.yaml")
    assert err.value.field == "inputs.1"


def test_fills_each_type_holds_parse() -> None:
    for element_type, fill in (("int64", -(2.0**40)), ("uint8", 255.0), ("bool", 1.0)):
        second = {"shape": [1], "element_type": element_type, "fill": fill}
        m = parse_manifest(_model(inputs=[{"shape": [3]}, second]), file="m.yaml")
        assert isinstance(m, ModelManifest) and m.inputs[1].fill == fill
    second = {"shape": [1], "element_type": "float32", "fill": 16000.0}
    assert isinstance(
        parse_manifest(_model(inputs=[{"shape": [3]}, second]), file="m"), ModelManifest
    )


def test_input_shapes_within_the_bounds_parse() -> None:
    for shape in ([], [1] * MAX_SAMPLE_DIMS, [MAX_SAMPLE_ELEMENTS], [3, 224, 224]):
        m = parse_manifest(_model(inputs=[{"shape": shape}]), file="m.yaml")
        assert isinstance(m, ModelManifest) and list(m.inputs[0].shape) == shape


def test_a_model_name_is_bounded_like_a_subject_token_and_a_zoo_directory() -> None:
    longest = "n" * NAME_MAX_CHARS
    assert NAME_MAX_CHARS == names.TOKEN_MAX_CHARS
    assert names.token(longest) == longest  # kept whole in its subjects
    assert zoo_coordinates(f"zoo://{longest}/1.0.0") == (longest, "1.0.0")
    m = parse_manifest(_model(name=longest), file="m.yaml")
    assert isinstance(m, ModelManifest)
    with pytest.raises(ManifestError, match=f"at most {NAME_MAX_CHARS} characters") as err:
        parse_manifest(_model(name="n" * 3000), file="m.yaml")
    assert err.value.field == "name"
    assert len(err.value.message) < 400  # the rejected value is quoted, not repeated
    with pytest.raises(ManifestError, match=f"at most {VERSION_MAX_CHARS} characters"):
        parse_manifest(_model(version="1.0.0+" + "a" * VERSION_MAX_CHARS), file="m.yaml")


def test_a_bus_value_with_an_absurd_shape_is_a_manifest_error() -> None:
    raw = json.dumps(_model(inputs=[{"shape": [3_000_000_000]}])).encode()
    with pytest.raises(ManifestError, match="elements") as err:
        _parse("m.1.0.0.noop", raw)
    assert err.value.file == "mlscope_models/m.1.0.0.noop"


UNBUILDABLE = {
    "impossible date": ("version: 2001-02-30", "day is out of range for month"),
    "tagged int": ("version: !!int abc", "not a valid int: 'abc'"),
    "tagged float": ("version: !!float abc", "not a valid float: 'abc'"),
    "tagged timestamp": ("version: !!timestamp abc", "not a valid timestamp: 'abc'"),
    "int past Python's digits": ("version: 1" + "0" * 5000, "not a valid int: '10000"),
    "nested": ("x: {y: [1, !!float q]}", "not a valid float: 'q'"),
    "a key": ("? !!int k\n: 1", "not a valid int: 'k'"),
}
"""Scalars that PyYAML resolves but cannot build: each raised a bare ValueError or
AttributeError from inside its constructor."""


@pytest.mark.parametrize("case", list(UNBUILDABLE))
def test_a_value_yaml_cannot_build_is_refused_on_its_line(tmp_path: Path, case: str) -> None:
    line, text = UNBUILDABLE[case]
    path = tmp_path / "m.yaml"
    path.write_text(f"kind: model\n{line}\n")
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    assert text in err.value.message and len(err.value.message) < 300
    assert err.value.file == str(path) and err.value.line == 2


def test_the_cli_and_the_catalog_report_an_unbuildable_value_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "manifests" / "bad.yaml"
    bad.parent.mkdir()
    bad.write_text("kind: model\nversion: 2001-02-30\n")
    for command in (["manifest", "validate"], ["models", "publish"]):
        assert mlscope_main([*command, str(bad)]) == 1
        err = capsys.readouterr().err
        assert f"{bad}:2: " in err and "Traceback" not in err
    with pytest.raises(ManifestError, match="day is out of range"):
        Catalog.load([bad.parent])


@pytest.mark.timeout(15)  # the old reader blocked in open() until a writer came
def test_a_fifo_named_as_a_manifest_is_refused_not_waited_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError, match=r"not a regular file \(a FIFO\)") as err:
        load_manifest(fifo)
    assert err.value.file == str(fifo)
    for command in (["manifest", "validate"], ["models", "publish"]):
        assert mlscope_main([*command, str(fifo)]) == 1
        assert f"{fifo}: not a regular file" in capsys.readouterr().err


@pytest.mark.timeout(15)
def test_a_directory_walk_refuses_a_fifo_among_manifests_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ok.yaml").write_text("kind: scenario\nname: online\nqps: 10\nduration_s: 1\n")
    os.mkfifo(tmp_path / "pipe.yaml")
    assert mlscope_main(["manifest", "validate", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert f"{tmp_path / 'ok.yaml'}: ok" in out.out
    assert f"{tmp_path / 'pipe.yaml'}: not a regular file (a FIFO)" in out.err
    assert "Traceback" not in out.err


@pytest.mark.timeout(15)  # the old reader blocked in open() until a writer came
def test_a_fifo_build_lock_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "data" / "zoo" / "digits_cnn" / "1.0.0"
    model_dir.mkdir(parents=True)
    (model_dir / "digits_cnn.onnx").write_text("junk")
    os.mkfifo(model_dir / LOCK_NAME)
    with pytest.raises(ArtifactError, match=r"not a regular file \(a FIFO\)"):
        BuildLock.read(model_dir)
    monkeypatch.setenv("MLSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLSCOPE_NATS_URL", "nats://127.0.0.1:9")
    mlscope_main(["models"])
    assert "Traceback" not in capsys.readouterr().err
