"""Where an untrusted manifest may make this machine fetch or read artifacts from.

A manifest from the bus (the ``mlscope_models`` bucket) was written by anyone who may
publish there. If its ``assets.base_url`` were followed like a local manifest's, it
could make every agent GET any URL (a request forgery from each agent host, and a
download into the data dir), or probe the agent's files (``file:///etc`` with a
guessed sha256 says whether a file exists). So an untrusted manifest may name only:

* ``zoo://NAME/VERSION``: the zoo directory, which holds what ``mlscope zoo build``
  made here or what the agent fetched from the bus's artifact store
  (``mlscope.artifact_bucket``, checked file by file against its build lock); and
* ``http(s)://`` URLs under a prefix the operator configured
  (``MLSCOPE_ARTIFACT_URL_PREFIXES``, none by default), compared after parsing: the
  same scheme, host and port, a path below the prefix's, no ``.``/``..`` segment, no
  user-info; a redirect must land under a prefix too.

Never ``file://``, ``pkg://``, a path relative to the manifest, or another host. Every
download, trusted or not, stops at a size cap (the manifest's ``assets.max_bytes``,
never above :attr:`FetchPolicy.max_bytes`) and is hashed as it streams.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from mlscope.errors import ArtifactError
from mlscope.settings import Settings

__all__ = ["BUS_SCHEMES", "DEFAULT_MAX_BYTES", "FetchPolicy"]

BUS_SCHEMES = ("zoo://",)
"""Locations an untrusted manifest may always name: what the bus's artifact store fills."""
DEFAULT_MAX_BYTES = 4 << 30


@dataclass(frozen=True, kw_only=True)
class FetchPolicy:
    """The operator's rules for downloads (see the module docstring)."""

    url_prefixes: tuple[str, ...] = ()
    """http(s) prefixes untrusted manifests may download from."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Ceiling on any one download, whatever a manifest declares."""

    @classmethod
    def from_settings(cls, settings: Settings) -> FetchPolicy:
        return cls(
            url_prefixes=settings.artifact_url_prefixes, max_bytes=settings.max_artifact_bytes
        )

    def cap(self, declared: int | None) -> int:
        """The size cap of one download: the declared size, at most the ceiling."""
        return min(declared, self.max_bytes) if declared else self.max_bytes

    def check_untrusted(self, base_url: str | None) -> None:
        """ArtifactError unless an untrusted manifest may name ``base_url``."""
        if base_url and base_url.startswith(BUS_SCHEMES):
            return
        if base_url and base_url.startswith(("http://", "https://")):
            self.check_url(base_url)
            return
        shown = base_url or "(the manifest's own directory)"
        raise ArtifactError(
            f"a manifest from the bus may not name {shown} as its asset location: only "
            f"{', '.join(BUS_SCHEMES)} (the bus's artifact store) or a URL under "
            "MLSCOPE_ARTIFACT_URL_PREFIXES",
            url=str(base_url or ""),
            reason="policy",
        )

    def check_url(self, url: str) -> None:
        """ArtifactError unless ``url`` lies under one of the configured prefixes."""
        if not any(_under(url, prefix) for prefix in self.url_prefixes):
            allowed = ", ".join(self.url_prefixes) or "none configured"
            raise ArtifactError(
                f"{url} is not under an allowed artifact URL prefix ({allowed}; "
                "MLSCOPE_ARTIFACT_URL_PREFIXES)",
                url=url,
                reason="policy",
            )

    def opener(self, *, untrusted: bool) -> urllib.request.OpenerDirector:
        """A urllib opener whose redirects, for an untrusted manifest, must stay under
        the prefixes too (an allowed host could otherwise bounce the agent anywhere)."""
        policy = self

        class Redirects(urllib.request.HTTPRedirectHandler):
            def redirect_request(
                self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
            ) -> Any:
                if untrusted:
                    policy.check_url(newurl)
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        return urllib.request.build_opener(Redirects)


def _under(url: str, prefix: str) -> bool:
    try:
        u, p = urllib.parse.urlsplit(url), urllib.parse.urlsplit(prefix)
        u_port, p_port = u.port, p.port
    except ValueError:
        return False
    if u.scheme not in ("http", "https") or (u.scheme, u.hostname, u_port) != (
        p.scheme,
        p.hostname,
        p_port,
    ):
        return False
    if u.username or u.password or "\\" in url:
        return False
    segments = urllib.parse.unquote(u.path).split("/")
    if any(s in (".", "..") for s in segments):
        return False
    base = p.path if p.path.endswith("/") else p.path + "/"
    return u.path + "/" == base or u.path.startswith(base)
