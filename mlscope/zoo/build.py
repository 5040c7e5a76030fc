"""``mlscope zoo build``: build every zoo artifact offline, idempotently.

Each builder writes into ``<zoo_dir>/<name>/<version>/`` and is skipped when every
file it produces already exists with the checksum its manifest pins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mlscope.artifacts import sha256_path

__all__ = ["BUILDERS", "Builder", "build"]


@dataclass(frozen=True)
class Builder:
    name: str
    version: str
    files: tuple[str, ...]
    run: Callable[[Path], None]


def _digits(out: Path) -> None:
    from mlscope.zoo import digits

    model = digits.train()
    digits.build_onnx(model, out)
    digits.write_holdout(out)


BUILDERS: dict[str, Builder] = {
    "digits_cnn": Builder("digits_cnn", "1.0.0",
                          ("digits_cnn.onnx", "holdout.npz", "labels.txt"), _digits),
}


def build(zoo_dir: Path, *, only: Iterable[str] | None = None, force: bool = False,
          log: Callable[[str], None] = print) -> dict[str, dict[str, str]]:
    """Build the selected models; returns ``{model: {file: sha256}}``."""
    wanted = list(only) if only else list(BUILDERS)
    unknown = [n for n in wanted if n not in BUILDERS]
    if unknown:
        raise KeyError(f"unknown zoo model(s) {unknown}; known: {sorted(BUILDERS)}")
    result: dict[str, dict[str, str]] = {}
    for name in wanted:
        b = BUILDERS[name]
        out = zoo_dir / b.name / b.version
        if force or not all((out / f).exists() for f in b.files):
            out.mkdir(parents=True, exist_ok=True)
            log(f"building {b.name} {b.version} -> {out}")
            b.run(out)
        else:
            log(f"{b.name} {b.version}: up to date")
        result[name] = {f: sha256_path(out / f) for f in b.files}
    return result
