"""The devices a predictor opens a model on: their names and the kind of each.

An agent's ``--device`` names one (``cpu``, ``cuda:1``, ``fpga:0``...); manifests and
system requirements speak of its kind (``cpu``, ``gpu``, ``fpga``): a framework
manifest's per-device options, a model's required device, an agent's devices matched
against the kind a job requires.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["DEVICE_KINDS", "Device", "device_kind", "device_problem"]

Device = Literal["cpu", "gpu", "fpga"]
"""A kind of device, as manifests and system requirements name it."""

DEVICE_KINDS: dict[str, Device] = {
    "cpu": "cpu",
    "cuda": "gpu",
    "gpu": "gpu",
    "tensorrt": "gpu",
    "fpga": "fpga",
}
"""The device names a predictor opens a model on, ``NAME`` or ``NAME:N`` (the N-th such
device), and the kind of device each is: ``cpu``; ``cuda`` (ONNX Runtime's CUDA
provider, PyTorch, TensorFlow), ``tensorrt`` (ONNX Runtime's TensorRT provider in front
of CUDA) and ``gpu`` name a GPU; ``fpga`` an XRT device."""


def device_kind(device: str) -> Device:
    """``cuda:1`` / ``tensorrt`` / ``gpu`` -> ``gpu``; ``fpga:0`` -> ``fpga``; else cpu."""
    return DEVICE_KINDS.get(device.split(":")[0], "cpu")


def device_problem(device: str) -> str | None:
    """Why ``device`` names no device a predictor opens (:data:`DEVICE_KINDS`, with an
    optional ``:N``), or None when it names one."""
    name, sep, index = device.partition(":")
    if name in DEVICE_KINDS and (not sep or (index.isascii() and index.isdigit())):
        return None
    known = ", ".join(DEVICE_KINDS)
    return f"unknown device {device!r}; known: {known}, each optionally :N (cuda:1)"
