"""The data manager: local, pkg:// and http(s) assets, cached and verified by sha256.

Remote assets are served by a real ``http.server`` on 127.0.0.1, port 0.
"""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mlscope.artifacts import ArtifactStore, resolve_package, safe_join
from mlscope.catalog import Catalog
from mlscope.errors import ArtifactError, ChecksumMismatch
from mlscope.hashing import sha256_path

PAYLOAD = b"weights " * 50_000


class _Server:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.hits: dict[str, int] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a: object, **kw: object) -> None:
                super().__init__(*a, directory=str(root), **kw)  # type: ignore[arg-type]

            def do_GET(self) -> None:
                with server.lock:
                    server.hits[self.path] = server.hits.get(self.path, 0) + 1
                super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    root = tmp_path / "served"
    (root / "models").mkdir(parents=True)
    (root / "models" / "net.onnx").write_bytes(PAYLOAD)
    with _Server(root) as s:
        yield s


SHA = hashlib.sha256(PAYLOAD).hexdigest()


def test_download_is_cached_by_checksum(tmp_path: Path, server: _Server) -> None:
    store = ArtifactStore(tmp_path / "data")
    path = store.download(f"{server.url}/models/net.onnx", SHA)
    assert path == tmp_path / "data" / "artifacts" / SHA / "net.onnx"
    assert path.read_bytes() == PAYLOAD
    assert store.download(f"{server.url}/models/net.onnx", SHA) == path
    assert server.hits["/models/net.onnx"] == 1
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".part")]


def test_checksum_mismatch_deletes_the_download(tmp_path: Path, server: _Server) -> None:
    store = ArtifactStore(tmp_path / "data")
    with pytest.raises(ChecksumMismatch) as info:
        store.download(f"{server.url}/models/net.onnx", "ab" * 32)
    assert SHA in str(info.value) and "models/net.onnx" in str(info.value)
    leftovers = [
        p
        for p in (tmp_path / "data" / "artifacts").rglob("*")
        if p.is_file() and not p.name.endswith(".lock")
    ]
    assert leftovers == []


def test_corrupt_cache_entry_is_fetched_again(tmp_path: Path, server: _Server) -> None:
    store = ArtifactStore(tmp_path / "data")
    path = store.download(f"{server.url}/models/net.onnx", SHA)
    path.write_bytes(b"bit rot")
    assert store.download(f"{server.url}/models/net.onnx", SHA).read_bytes() == PAYLOAD
    assert server.hits["/models/net.onnx"] == 2


def test_unreachable_url_names_it(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/models/net.onnx"
    with pytest.raises(ArtifactError) as info:
        ArtifactStore(tmp_path / "data", timeout_s=5).download(url, SHA)
    assert url in str(info.value) and info.value.fields["url"] == url


def test_http_404_names_url(tmp_path: Path, server: _Server) -> None:
    url = f"{server.url}/models/missing.onnx"
    with pytest.raises(ArtifactError, match="404") as info:
        ArtifactStore(tmp_path / "data").download(url, SHA)
    assert url in str(info.value)


def test_concurrent_requests_download_once(tmp_path: Path, server: _Server) -> None:
    store = ArtifactStore(tmp_path / "data")
    url = f"{server.url}/models/net.onnx"
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: store.download(url, SHA), range(16)))
    assert len(set(paths)) == 1 and server.hits["/models/net.onnx"] == 1
    # a second store (as another process would) shares the cache, by checksum
    assert ArtifactStore(tmp_path / "data").download(url, SHA) == paths[0]
    assert server.hits["/models/net.onnx"] == 1


def test_resolve_refuses_escapes(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "data")
    for bad in ("../x.onnx", "a/../../x.onnx", "/etc/passwd"):
        with pytest.raises(ArtifactError):
            store.resolve(None, bad, SHA, manifest_dir=tmp_path)
        with pytest.raises(ArtifactError):
            store.resolve("http://127.0.0.1:1/m", bad, SHA, manifest_dir=tmp_path)
    with pytest.raises(ArtifactError, match="escapes"):
        safe_join(tmp_path, "../x")
    # a symlink that points out of the root is refused as well
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "data")
    with pytest.raises(ArtifactError, match="escapes"):
        store.resolve(None, "link/x", SHA, manifest_dir=tmp_path / "root")


def test_local_asset_verified_and_never_deleted(tmp_path: Path) -> None:
    (tmp_path / "net.onnx").write_bytes(PAYLOAD)
    store = ArtifactStore(tmp_path / "data")
    assert store.resolve(None, "net.onnx", SHA, manifest_dir=tmp_path) == tmp_path / "net.onnx"
    (tmp_path / "net.onnx").write_bytes(PAYLOAD + b"!")
    with pytest.raises(ChecksumMismatch):
        store.resolve(None, "net.onnx", SHA, manifest_dir=tmp_path)
    assert (tmp_path / "net.onnx").exists()
    with pytest.raises(ArtifactError, match="missing"):
        store.resolve(None, "other.onnx", SHA, manifest_dir=tmp_path)


def test_pkg_resolver_finds_wheel_files() -> None:
    light = resolve_package("pkg://onnx/backend/test/data/light")
    assert (light / "light_resnet50.onnx").is_file()
    with pytest.raises(ArtifactError, match="not installed"):
        resolve_package("pkg://no_such_package_here/x")
    with pytest.raises(ArtifactError):
        resolve_package("pkg://onnx/../../etc")


def test_directory_checksum_covers_names_and_contents(tmp_path: Path) -> None:
    d = tmp_path / "sm"
    (d / "variables").mkdir(parents=True)
    (d / "saved_model.pb").write_bytes(b"graph")
    (d / "variables" / "v.data").write_bytes(b"w")
    before = sha256_path(d)
    (d / "variables" / "v.data").rename(d / "variables" / "w.data")
    assert sha256_path(d) != before


def _manifest(mdir: Path, base_url: str, sha: str) -> Path:
    mdir.mkdir(exist_ok=True)
    path = mdir / "net.onnxruntime.yaml"
    path.write_text(f"""\
name: net
version: 1.0.0
task: latency
framework: {{name: onnxruntime}}
inputs: [{{shape: [3]}}]
outputs: [{{}}]
assets:
  base_url: {base_url}
  graph_path: net.onnx
  sha256: {sha}
""")
    return path


def test_catalog_entry_downloads_http_assets(tmp_path: Path, server: _Server) -> None:
    mdir = _manifest(tmp_path / "manifests", f"{server.url}/models", SHA).parent
    entry = Catalog.load([mdir]).find("net")
    zoo = tmp_path / "data" / "zoo"
    path = entry.graph(zoo)
    assert path == tmp_path / "data" / "artifacts" / SHA / "net.onnx"
    assert entry.graph(zoo) == path and server.hits["/models/net.onnx"] == 1


def test_checksum_mismatch_names_the_manifest_file_and_field(
    tmp_path: Path, server: _Server
) -> None:
    wrong = "a" * 64
    path = _manifest(tmp_path / "manifests", f"{server.url}/models", wrong)
    with pytest.raises(ChecksumMismatch) as info:
        Catalog.load([path.parent]).find("net").graph(tmp_path / "data" / "zoo")
    assert str(path) in str(info.value) and "field 'assets.sha256'" in str(info.value)
    assert info.value.fields["file"] == str(path)
    assert info.value.fields["field"] == "assets.sha256"
    assert not list((tmp_path / "data").rglob("net.onnx"))  # the bad download is not kept


def test_unreachable_url_names_the_manifest_file_and_field(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = _manifest(tmp_path / "manifests", f"http://127.0.0.1:{port}/models", SHA)
    entry = Catalog.load([path.parent]).find("net")
    with pytest.raises(ArtifactError) as info:
        entry.graph(tmp_path / "data" / "zoo", store=ArtifactStore(tmp_path / "data", timeout_s=5))
    message = str(info.value)
    assert str(path) in message and "field 'assets.graph_path'" in message
    assert f"127.0.0.1:{port}" in message
