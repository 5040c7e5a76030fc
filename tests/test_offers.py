"""What an agent serves and why it refuses the rest (``agent.offers``), on the real
catalog's entries: one entry's failure, of any kind, refuses that entry only."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.offers import servable, verified_graph
from mlscope.artifacts import ArtifactStore
from mlscope.catalog import Catalog, Entry, default_manifest_dirs
from mlscope.errors import ConfigError, MLScopeError


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return list(Catalog.load(default_manifest_dirs()).entries)


def _onnx(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.manifest.framework.name == "onnxruntime"]


def test_every_entry_of_the_framework_is_served_or_refused_with_its_reason(
    entries: list[Entry],
) -> None:
    onnx = _onnx(entries)
    assert len(onnx) >= 4
    bad = {
        onnx[0].manifest.key: ConfigError("too old here", reason="framework_version"),
        onnx[1].manifest.key: OSError("a socket where the graph should be"),
        onnx[2].manifest.key: MLScopeError("not here", reason="custom_code"),
        onnx[3].manifest.key: MLScopeError("odd", reason="not-a-reason"),
    }

    def check(e: Entry) -> Path:
        failure = bad.get(e.manifest.key)
        if failure is not None:
            raise failure
        return Path("/graphs") / e.manifest.name

    served, refused = servable(entries, framework="onnxruntime", check=check)
    # every onnxruntime entry is one or the other, once
    named = [(e.manifest.name, e.manifest.version) for e, _ in served]
    named += [(r.name, r.version) for r in refused]
    assert sorted(named) == sorted((e.manifest.name, e.manifest.version) for e in onnx)
    assert all(e.manifest.framework.name == "onnxruntime" for e, _ in served)
    assert all(g == Path("/graphs") / e.manifest.name for e, g in served)
    why = {(r.name, r.version): r for r in refused}
    first, second, third = (why[(e.manifest.name, e.manifest.version)] for e in onnx[:3])
    assert first.reason == "framework_version" and first.message == "too old here"
    assert second.reason == "invalid" and second.message.startswith("OSError: a socket")
    assert third.reason == "custom_code" and third.message == "not here"
    assert why[(onnx[3].manifest.name, onnx[3].manifest.version)].reason == "invalid"
    assert {r.framework for r in refused} == {"onnxruntime"}


def test_a_runtime_outside_the_manifest_range_is_refused_before_any_file_is_read(
    entries: list[Entry], tmp_path: Path
) -> None:
    e = _onnx(entries)[0]
    with pytest.raises(ConfigError) as err:
        verified_graph(
            e,
            runtime_version="0.0.1",
            zoo_dir=tmp_path / "no-zoo",
            store=ArtifactStore(tmp_path / "cache"),
            allow_custom=False,
        )
    assert err.value.fields["reason"] == "framework_version"
    assert "0.0.1" in err.value.message
