"""What an agent may serve: the manifests of its framework that its runtime, its data
directory and its policy allow, and for every other one of them why not.

Pure functions over the catalog's entries: the agent calls :func:`servable` at start
and whenever the models bucket changes, and advertises both lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import get_args

from agent.worker import compile_model
from mlscope.artifacts import ArtifactStore
from mlscope.catalog import Entry
from mlscope.contracts import RefusalReason, RefusedModel
from mlscope.errors import ConfigError, MLScopeError
from mlscope.versions import satisfies

__all__ = ["Offer", "refusal", "servable", "verified_graph"]

log = logging.getLogger("mlscope.agent")

Offer = tuple[Entry, Path]
"""A servable entry and its verified graph path."""

_REASONS: dict[str, RefusalReason] = {r: r for r in get_args(RefusalReason)}
"""A typed error's ``reason`` field -> the refusal's reason (anything else: invalid)."""


def servable(
    entries: Iterable[Entry], *, framework: str, check: Callable[[Entry], Path]
) -> tuple[list[Offer], list[RefusedModel]]:
    """The entries of ``framework`` (local or from the bus) that ``check`` passes (the
    agent's :func:`verified_graph`), each with its verified graph; and every other entry
    of the framework with the reason it is refused. Any exception of one entry refuses
    that entry only."""
    out, refused = [], []
    for e in entries:
        if e.manifest.framework.name != framework:
            continue
        try:
            out.append((e, check(e)))
        except MLScopeError as exc:
            refused.append(refusal(e, exc))
        except Exception as exc:  # one odd manifest (an asset that is a socket...)
            refused.append(refusal(e, MLScopeError(f"{type(exc).__name__}: {exc}")))
            log.warning("not serving %s: %r", e.manifest.key, exc)
    return out, refused


def verified_graph(
    e: Entry, *, runtime_version: str, zoo_dir: Path, store: ArtifactStore, allow_custom: bool
) -> Path:
    """The verified graph path of an entry this runtime may serve: its version satisfies
    the manifest's, its artifacts are present and verified here (against the manifest's
    pin or the build lock) and its steps may run here (custom Python only from a
    trusted local manifest on an agent that allows it). A typed error says why not."""
    m = e.manifest
    if not satisfies(runtime_version, m.framework.version):
        raise ConfigError(
            f"{m.framework.name} {runtime_version} here is outside the manifest's "
            f"{m.framework.version!r}",
            reason="framework_version",
        )
    compile_model(e, allow_custom=allow_custom)
    return e.graph(zoo_dir, store=store)


def refusal(e: Entry, exc: MLScopeError) -> RefusedModel:
    """Why an entry is not served, from the typed error that refused it."""
    m = e.manifest
    reason = _REASONS.get(str(exc.fields.get("reason")), "invalid")
    fix = exc.fields.get("fix") or None
    return RefusedModel(
        name=m.name,
        version=m.version,
        framework=m.framework.name,
        reason=reason,
        message=exc.message,
        fix=str(fix) if fix else None,
    )
