"""TensorFlow predictor: a SavedModel's signature on the CPU or a GPU.

The signature is ``serving_default`` unless ``options.runtime["signature"]`` names
another (Keras 3 ``model.export()`` writes ``serve`` and ``serving_default``); a
framework manifest sets it under ``options.extra``.
Signatures take and return *named* tensors; ``predict`` takes and returns lists, so:

- list inputs map to the signature's input names in manifest order: the names are
  ``manifest.inputs[i].layer_name`` when every input gives one, else the signature's
  input names sorted;
- outputs are ordered by ``manifest.outputs[i].layer_name`` when every output gives
  one, else by the signature's output names sorted.

A SavedModel that ``tf.saved_model.load`` refuses (TF1-era ones with optimizer slots,
e.g. basic_pitch) is loaded with the v1 loader into its own graph and session, and its
signature runs through ``Session.run`` behind the same interface.

Threads: ``options.threads`` (else the manifest's ``intra_op_threads``) and
``options.runtime["inter_op_threads"]`` (0: TensorFlow's default) are TensorFlow
process-wide settings that can only be set before the runtime starts;
the first predictor opened in a process decides them (a later conflicting request is
logged, not silently claimed).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # C++ INFO/WARNING lines are noise here

import tensorflow as tf

from agent.predictors import TensorSig, batch_axes, check_inputs, device_index
from mlscope.contracts import FrameworkInfo
from mlscope.errors import InferenceError, ModelLoadError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["TensorFlowPredictor", "open", "probe"]

FRAMEWORK = "tensorflow"
log = logging.getLogger(__name__)


def probe() -> FrameworkInfo:
    gpus = tf.config.list_physical_devices("GPU")
    devices = ["cpu", *(f"cuda:{i}" for i in range(len(gpus)))]
    return FrameworkInfo(name=FRAMEWORK, version=tf.__version__, devices=tuple(devices))


class TensorFlowPredictor:
    framework = FRAMEWORK

    def __init__(
        self, loaded: Any, signature: Any, manifest: ModelManifest, device: str, tf_device: str
    ) -> None:
        self._loaded = loaded  # the signature holds only weak references to its variables
        self._signature: Any = signature
        self.model = manifest.name
        self.device = device
        self._tf_device = tf_device
        specs: dict[str, Any] = signature.structured_input_signature[1]
        self._input_names = _ordered(
            [i.layer_name for i in manifest.inputs], specs, "input", manifest
        )
        axes = batch_axes(manifest, self._input_names)
        self._sigs = [
            TensorSig(
                name=n,
                dtype=np.dtype(specs[n].dtype.as_numpy_dtype),
                shape=tuple(specs[n].shape.as_list()),
                batch_axis=axis,
            )
            for n, axis in zip(self._input_names, axes, strict=True)
        ]
        self._output_names = _ordered(
            [o.layer_name for o in manifest.outputs],
            signature.structured_outputs,
            "output",
            manifest,
        )

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        signature = self._signature
        if signature is None:
            raise InferenceError(
                f"{self.model}: predictor is closed", model=self.model, framework=FRAMEWORK
            )
        check_inputs(inputs, self._sigs, model=self.model, framework=FRAMEWORK)
        try:
            with tf.device(self._tf_device):
                out = signature(**dict(zip(self._input_names, inputs, strict=True)))
            # .numpy() copies to the host, which waits for the device: synchronized here.
            return [_host(out[name]) for name in self._output_names]
        except Exception as exc:  # tf.errors.* and friends; translated here only
            raise InferenceError(
                f"{self.model}: {exc}",
                model=self.model,
                framework=FRAMEWORK,
                device=self.device,
                batch_size=len(inputs[0]),
            ) from exc

    def effective_options(self) -> dict[str, Any]:
        """TensorFlow's process-wide thread pools (0: its default) and the device."""
        threading = tf.config.threading
        return {
            "device": self.device,
            "intra_op_threads": int(threading.get_intra_op_parallelism_threads()),
            "inter_op_threads": int(threading.get_inter_op_parallelism_threads()),
        }

    def close(self) -> None:
        self._signature = None
        loaded, self._loaded = self._loaded, None
        if isinstance(loaded, _V1Signature):
            loaded.close()


def _host(t: Any) -> np.ndarray:
    out: np.ndarray = t if isinstance(t, np.ndarray) else t.numpy()
    return out


class _V1Signature:
    """A TF1-style SavedModel signature run in its own graph and session, shaped like
    the TF2 concrete function :class:`TensorFlowPredictor` calls (its input specs,
    output names, and ``__call__(**inputs) -> {name: array}``)."""

    def __init__(self, path: Path, tags: list[str], name: str) -> None:
        self._graph = tf.Graph()
        self._session = tf.compat.v1.Session(graph=self._graph)
        with self._graph.as_default():
            meta = tf.compat.v1.saved_model.loader.load(self._session, tags, str(path))
        if name not in meta.signature_def:
            self.close()
            raise KeyError(f"no signature {name!r} (has {sorted(meta.signature_def)})")
        sig = meta.signature_def[name]
        self._feeds = {k: v.name for k, v in sig.inputs.items()}
        self.structured_outputs = {k: v.name for k, v in sig.outputs.items()}
        self.structured_input_signature = (
            (),
            {
                k: tf.TensorSpec(
                    [d.size if d.size >= 0 else None for d in v.tensor_shape.dim],
                    tf.as_dtype(v.dtype),
                )
                for k, v in sig.inputs.items()
            },
        )

    def __call__(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = self._session.run(
            self.structured_outputs, {self._feeds[k]: v for k, v in inputs.items()}
        )
        return out

    def close(self) -> None:
        self._session.close()


def open(
    model_path: Path, manifest: ModelManifest, options: PredictorOptions
) -> TensorFlowPredictor:
    device, tf_device = _device(options, manifest)
    _set_threads(options)
    name = str(options.runtime.get("signature", "serving_default"))
    try:
        with tf.device(tf_device):
            loaded = tf.saved_model.load(str(model_path))
    except Exception as exc:  # OSError, ValueError, tf.errors.*: translated once
        # Some TF1-era SavedModels (optimizer slots) only load through the v1 loader.
        try:
            with tf.device(tf_device):
                v1 = _V1Signature(model_path, ["serve"], name)
        except Exception:
            raise ModelLoadError(
                f"cannot load SavedModel {model_path}: {exc}",
                model=manifest.name,
                framework=FRAMEWORK,
                device=options.device,
            ) from exc
        return TensorFlowPredictor(v1, v1, manifest, device, tf_device)
    signatures = getattr(loaded, "signatures", {})
    if name not in signatures:
        raise ModelLoadError(
            f"{model_path} has no signature {name!r} (has {sorted(signatures)})",
            model=manifest.name,
            framework=FRAMEWORK,
            expected=name,
            actual=sorted(signatures),
        )
    return TensorFlowPredictor(loaded, signatures[name], manifest, device, tf_device)


def _device(options: PredictorOptions, manifest: ModelManifest) -> tuple[str, str]:
    kind = options.device.split(":")[0]
    if kind == "cpu":
        return "cpu", "/CPU:0"
    if kind not in ("cuda", "gpu"):
        raise ModelLoadError(
            f"tensorflow has no device {options.device!r}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    idx = device_index(options.device)
    gpus = tf.config.list_physical_devices("GPU")
    if idx >= len(gpus):
        raise ModelLoadError(
            f"tensorflow {tf.__version__} sees {len(gpus)} GPU(s); {options.device} is not one",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    return f"cuda:{idx}", f"/GPU:{idx}"


def _set_threads(options: PredictorOptions) -> None:
    threading = tf.config.threading
    wanted = [
        (
            options.intra_op_threads,
            threading.get_intra_op_parallelism_threads,
            threading.set_intra_op_parallelism_threads,
        ),
        (
            options.runtime.get("inter_op_threads"),
            threading.get_inter_op_parallelism_threads,
            threading.set_inter_op_parallelism_threads,
        ),
    ]
    for value, get, put in wanted:
        if not value or get() == int(value):
            continue
        try:
            put(int(value))
        except RuntimeError:  # the runtime already started: the setting is fixed for good
            log.warning(
                "tensorflow already initialized with %d threads; cannot use %s", get(), value
            )


def _ordered(
    manifest_names: list[str | None], named: dict[str, Any], what: str, manifest: ModelManifest
) -> list[str]:
    if manifest_names and all(n is not None for n in manifest_names):
        names = [n for n in manifest_names if n is not None]
        unknown = [n for n in names if n not in named]
        if unknown:
            raise ModelLoadError(
                f"{manifest.name}: manifest {what}(s) {unknown} not in the signature "
                f"(has {sorted(named)})",
                model=manifest.name,
                framework=FRAMEWORK,
                expected=sorted(named),
                actual=names,
            )
        return names
    return sorted(named)
