"""Manifests from the models bucket are untrusted: what the watcher holds is bounded
and tied to its key, and the steps of what it holds cannot make a query allocate
without bound. A real nats-server; no agent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from cli import models_cmd
from mlscope import bus as busmod
from mlscope import model_registry, names
from mlscope.errors import ManifestError
from mlscope.image_ops import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE
from mlscope.logbudget import LOG_BURST
from mlscope.model_registry import ManifestWatcher, delete_manifest, key_for
from mlscope.natsserver import NatsServer
from mlscope.operators import compile_steps
from mlscope.provision import provisioned
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(60)


def doc(name: str = "live", shape: list[int] | None = None, **changes: Any) -> bytes:
    return json.dumps(
        {
            "kind": "model",
            "task": "t",
            "name": name,
            "version": "1.0.0",
            "framework": {"name": "noop", "version": "*"},
            "inputs": [{"shape": shape or [16]}],
            "outputs": [{}],
            "assets": {"base_url": f"zoo://{name}/1.0.0", "graph_path": "g"},
            **changes,
        }
    ).encode()


def snapshot_after(
    server: NatsServer, tmp_path: Path, puts: dict[str, bytes], *, delete: str | None = None
) -> ManifestWatcher:
    """The watcher's view of the bucket once ``puts`` are stored (and ``delete``
    removed with ``mlscope models remove``'s function)."""
    settings = Settings(nats_url=server.url, data_dir=tmp_path / "d")

    async def go() -> ManifestWatcher:
        async with provisioned(settings, name="t") as bus:
            kv = await bus.kv(names.MODELS_BUCKET)
            for key, value in puts.items():
                await kv.put(key, value)
            if delete is not None:
                await delete_manifest(bus, delete)
            return await ManifestWatcher.snapshot(bus, log=lambda _line: None)

    return anyio.run(go)


def test_a_manifest_under_a_key_not_its_own_is_rejected(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    key = key_for("live", "1.0.0", "noop")
    snap = snapshot_after(nats_server, tmp_path, {key: doc(), "zzz": doc(shape=[999])})
    assert list(snap.entries) == [key]
    assert snap.entries[key].manifest.inputs[0].shape == (16,)
    assert list(snap.rejected) == ["zzz"]
    assert f"belongs under the key {key}" in snap.rejected["zzz"].message
    gone = snapshot_after(nats_server, tmp_path, {}, delete=key)
    assert gone.entries == {}  # `models remove` leaves no impostor serving the model


def test_a_manifest_with_an_absurd_shape_is_rejected_by_the_watcher(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    puts = {
        key_for(n, "1.0.0", "noop"): doc(n, shape)
        for n, shape in {"neg": [-5], "dims": [1] * 40, "huge": [10**12]}.items()
    }
    snap = snapshot_after(nats_server, tmp_path, puts)
    assert snap.entries == {}
    assert sorted(snap.rejected) == sorted(puts)
    assert all(e.field == "inputs.0.shape" for e in snap.rejected.values())


def test_the_watcher_holds_a_bounded_number_of_manifests(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_registry, "MAX_REMOTE_MANIFESTS", 3)
    puts = {key_for(f"m{i}", "1.0.0", "noop"): doc(f"m{i}") for i in range(5)}
    snap = snapshot_after(nats_server, tmp_path, puts)
    assert len(snap.entries) == 3 and len(snap.rejected) == 2
    assert set(snap.entries) | set(snap.rejected) == set(puts)
    assert all("more than 3 manifests" in e.message for e in snap.rejected.values())


# ------------------------------------------------------------------ operator options


@pytest.mark.parametrize(
    ("step", "text"),
    [
        ({"resize": {"size": [60000, 60000]}}, f"from 1 to {MAX_IMAGE_SIDE}"),
        ({"resize": {"size": [MAX_IMAGE_SIDE, MAX_IMAGE_SIDE]}}, f"{MAX_IMAGE_PIXELS} pixels"),
        ({"resize": {"size": -3}}, "from 1 to"),
        ({"resize": {"size": 224, "method": "magic"}}, "method must be one of"),
        ({"resize": {}}, "missing a required argument: 'size'"),
        ({"center_crop": {"size": [224, 10**9]}}, f"from 1 to {MAX_IMAGE_SIDE}"),
        ({"center_crop": {"size": [1, 2, 3]}}, "one number or"),
        ({"topk": {"k": 0}}, "from 1 to"),
        ({"topk": {"k": True}}, "from 1 to"),
        ({"reshape": {"shape": [1] * 40}}, "at most 32 dimensions"),
        ({"reshape": {"shape": [-1, -1]}}, "except one"),
        ({"cast": {"dtype": "V1000000000"}}, "not a numeric type"),
        ({"cast": {"dtype": "no such type"}}, "options of 'cast'"),
        ({"layout": {"source": "HWC", "target": "CHWN"}}, "cannot convert"),
        ({"reduce": {"op": "median"}}, "op must be one of"),
        ({"color_mode": {"target": "CMYK"}}, "color modes are"),
        ({"normalize": {"rescale": 1.0, "gamma": 2}}, "unexpected keyword argument 'gamma'"),
    ],
)
def test_operator_options_are_checked_when_steps_compile(step: dict[str, Any], text: str) -> None:
    with pytest.raises(ManifestError, match=text) as err:
        compile_steps([{"identity": None}, step], where="inputs.0.steps")
    assert err.value.field == "inputs.0.steps.1"


def test_operator_options_within_the_bounds_compile_and_run() -> None:
    images = np.zeros((2, 40, 30, 3), np.uint8)
    run = compile_steps(
        [
            {"resize": {"size": 32, "keep_aspect": True}},
            {"center_crop": {"size": [24, 24]}},
            {"layout": {"source": "HWC", "target": "CHW"}},
            {"cast": {"dtype": "float32"}},
            {"reshape": {"shape": [-1]}},
            {"topk": {"k": 3}},
        ]
    )
    assert run(images).shape == (2, 3)


def test_resize_keeping_the_aspect_of_a_thin_image_is_bounded_per_image() -> None:
    """An int size with keep_aspect sets the shorter side: the longer one follows the
    image, so that bound is checked per image."""
    run = compile_steps([{"resize": {"size": 4096, "keep_aspect": True}}])
    with pytest.raises(ValueError, match="pixels"):
        run([np.zeros((1, 64, 3), np.uint8)])


FLOOD = 3 * LOG_BURST
"""Invalid manifests put on the bus: three times what the watcher logs in a window."""


def flooded(nats_server: NatsServer, tmp_path: Path) -> Settings:
    """Settings of a bus whose models bucket holds :data:`FLOOD` invalid manifests."""
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "d")

    async def put() -> None:
        async with provisioned(settings, name="t") as bus:
            kv = await bus.kv(names.MODELS_BUCKET)
            for i in range(FLOOD):
                await kv.put(f"bad{i}", b"{not json")

    anyio.run(put)
    return settings


def test_a_flood_of_bad_manifests_is_rejected_in_full_but_logged_briefly(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    settings = flooded(nats_server, tmp_path)
    lines: list[str] = []

    async def go() -> ManifestWatcher:
        async with busmod.connect(settings, name="t") as bus:
            return await ManifestWatcher.snapshot(bus, log=lines.append)

    snap = anyio.run(go)
    assert len(snap.rejected) == FLOOD and snap.entries == {}
    assert LOG_BURST <= len(lines) <= 2 * LOG_BURST  # a second window on a very slow run
    assert all("ignoring a manifest" in x for x in lines)


def test_mlscope_models_says_how_many_invalid_manifests_it_did_not_list(
    nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = flooded(nats_server, tmp_path)
    parser = argparse.ArgumentParser()
    models_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["models", "--remote"])
    args.settings = settings
    assert args.func(args) == 0
    err = capsys.readouterr().err.splitlines()
    listed = len([x for x in err if "ignoring a manifest" in x])
    assert LOG_BURST <= listed <= 2 * LOG_BURST  # a second window on a very slow run
    assert f"mlscope models: {FLOOD - listed} more manifests on the bus are invalid" in err[-1]
