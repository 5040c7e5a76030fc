"""Optional dependencies: import one, or say in one line which extra installs it.

The core install (``pip install mlscope``) runs the bus, the server, agents and every
command's ``--help``. A feature whose package lives in an extra of ``pyproject.toml``
imports it through :func:`require` at the point of use, so that a missing package is a
:class:`~mlscope.errors.MissingExtra` naming the extra, never a traceback::

    mlscope report: a report with figures needs matplotlib: pip install 'mlscope[report]'

Frameworks have their own guard (``agent.predictors``, :class:`FrameworkUnavailable`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mlscope.errors import MissingExtra

__all__ = ["require"]


def require(module: str, *, extra: str, needed_for: str, package: str | None = None) -> ModuleType:
    """``import module``, or raise :class:`MissingExtra` (also an ``ImportError``).

    ``needed_for`` says what wants it ("a report with figures"); ``package`` is the
    distribution's name where it differs from the module's (``PIL`` is ``pillow``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        if exc.name is not None and exc.name.partition(".")[0] != top:
            raise  # the package is there, one of its own imports is broken: show that
        raise MissingExtra(
            f"{needed_for} needs {package or top}: pip install 'mlscope[{extra}]'",
            module=module,
            extra=extra,
        ) from exc
