"""A zoo model's pinned behaviour: how a build's measurements are checked and recorded.

A built model is not pinned by its bytes (they differ from CPU to CPU) but by what it
does: its accuracy on its data set and its class probabilities on a few probe rows,
each with a tolerance (the manifests' ``build.behaviour``), in every format.
:func:`check_behaviour` says how a measurement departs from the pins;
:func:`summarize` is what the model directory's build lock keeps of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlscope.manifest import Behaviour

__all__ = ["check_behaviour", "summarize", "top5"]


def check_behaviour(name: str, measured: Mapping[str, Any], pins: Behaviour) -> list[str]:
    """How the measured behaviour (every format) departs from the pins; empty if none."""
    problems = []
    for fw, accuracy in measured["accuracy"].items():
        if abs(accuracy - pins.accuracy) > pins.accuracy_tolerance + 1e-9:
            problems.append(
                f"{name} on {fw}: accuracy {accuracy:.4f}, pinned "
                f"{pins.accuracy:.4f} ± {pins.accuracy_tolerance}"
            )
    for fw, probs in measured.get("probabilities", {}).items():
        for probe in pins.probes:
            p = probs.get(str(probe.sample))
            if p is None:
                problems.append(f"{name} on {fw}: probe row {probe.sample} was not measured")
                continue
            answer, expected = max(range(len(p)), key=p.__getitem__), probe.top5[0][0]
            # A near tie in the pin (runner-up within the tolerance) may break either way.
            tie = (
                len(probe.top5) > 1
                and probe.top5[0][1] - probe.top5[1][1] <= 2 * pins.probe_tolerance
            )
            if answer != expected and not tie:
                problems.append(
                    f"{name} on {fw}: row {probe.sample} answers class {answer}, pinned {expected}"
                )
            worst = max(abs(p[c] - ref) for c, ref in probe.top5)
            if worst > pins.probe_tolerance:
                problems.append(
                    f"{name} on {fw}: row {probe.sample} probabilities differ "
                    f"by {worst:.4g} from the pinned (tolerance "
                    f"{pins.probe_tolerance})"
                )
    return problems


def summarize(measured: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a lock keeps of a measurement: accuracies and each probe's top 5."""
    if not measured:
        return {}
    probes = {
        fw: [{"sample": int(row), "top5": top5(p)} for row, p in rows.items()]
        for fw, rows in measured.get("probabilities", {}).items()
    }
    return {"samples": measured["samples"], "accuracy": measured["accuracy"], "probes": probes}


def top5(probabilities: Sequence[float]) -> list[list[float]]:
    order = sorted(range(len(probabilities)), key=lambda c: -probabilities[c])[:5]
    return [[c, round(float(probabilities[c]), 4)] for c in order]
