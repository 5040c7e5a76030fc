"""Bounded parsing of untrusted documents: manifest YAML files and bus JSON values.

A manifest may come from anyone who can write a file or publish to the bus, so
parsing it must cost bounded time and memory and fail with a ``file:line`` error,
never a traceback:

* **size**: at most :data:`MAX_DOCUMENT_BYTES`, checked before the bytes are read;
* **encoding**: UTF-8 only; a bad byte is reported with its line and column;
* **depth**: collections nest at most :data:`MAX_DEPTH` levels (PyYAML's composer
  and ``json`` recurse, and 20,000 levels overflowed the stack);
* **aliases**: at most :data:`MAX_ALIASES` ``*alias`` references, and the document
  *expanded* (every alias counted as a copy of what it names) has at most
  :data:`MAX_NODES` nodes: a kilobyte "billion laughs" file would otherwise
  validate quickly (aliases share objects) and explode when it is serialized;
* **duplicate keys** are an error (YAML says keys are unique; PyYAML keeps the
  last one silently, so a second ``sha256:`` would quietly win);
* **values PyYAML cannot build** (``2001-02-30``, ``!!int abc``, an int of more
  digits than Python converts) are an error on their line, not a ValueError from
  deep inside the constructor.

A manifest is read as every file users name is (:mod:`mlscope.regular_files`): a FIFO,
device or directory is refused at once, a file over the limit by its size.

Arrays another process wrote (an ``.npz`` of a load generator's or LoadGen's run) are
read by their headers first (:func:`npz_headers`): a small compressed file can claim
gigabytes, and the caller checks shapes and types before anything is decompressed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.resolver import Resolver

from mlscope.errors import ManifestError
from mlscope.regular_files import FileTooLarge, NotRegularFile, byte_position, read_regular

__all__ = [
    "MAX_ALIASES",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "MAX_NODES",
    "json_depth",
    "load_json",
    "load_yaml_bounded",
    "npz_headers",
]

MAX_DOCUMENT_BYTES = 1 << 20
"""1 MiB: the largest manifest in the repository is a few kilobytes."""
MAX_DEPTH = 64
MAX_ALIASES = 256
MAX_NODES = 100_000


class _Limit(Exception):
    """Raised inside the loader; turned into a ManifestError with the node's line."""

    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.message, self.line = message, line


class _BoundedComposer(Composer):  # type: ignore[misc]
    """PyYAML's composer, counting depth and aliases as it composes and refusing
    duplicate keys; the expansion check runs on the composed graph."""

    _depth = 0
    _aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Limit(f"more than {MAX_ALIASES} aliases", _line(self.peek_event()))
            return Composer.compose_node(self, parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Limit(f"nested deeper than {MAX_DEPTH} levels", _line(self.peek_event()))
            return Composer.compose_node(self, parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:
        node = Composer.compose_mapping_node(self, anchor)
        seen: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            ident = (
                str(
                    self.resolve(yaml.ScalarNode, key.value, (True, False))
                    if key.tag is None
                    else key.tag
                ),
                str(key.value),
            )
            line = int(key.start_mark.line) + 1
            if ident in seen:
                raise _Limit(f"duplicate key {key.value!r} (first on line {seen[ident]})", line)
            seen[ident] = line
        return node


class _BoundedConstructor(SafeConstructor):  # type: ignore[misc]
    """PyYAML's safe constructor, with a value it cannot build (``2001-02-30``,
    ``!!float abc``, an int past Python's digit limit) refused on its own line: those
    raise plain ValueError and kin from the constructor, with no mark."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return SafeConstructor.construct_object(self, node, deep)
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            kind = str(node.tag).rpartition(":")[2] or "value"
            # ValueError says why (``day is out of range for month``); the others
            # only say where inside PyYAML it broke.
            why = f" ({str(exc).split(';', 1)[0]})" if isinstance(exc, ValueError) else ""
            raise _Limit(
                f"not a valid {kind}: {_clip(str(node.value))!r}{why}",
                int(node.start_mark.line) + 1,
            ) from None


def _clip(text: str, at: int = 40) -> str:
    return text if len(text) <= at else f"{text[:at]}... ({len(text)} characters)"


try:
    # libyaml scans and parses (in C: a quarter of the pure-Python time on the catalog's
    # manifests); the bounded composer above still builds the nodes from its events.
    from yaml._yaml import CParser

    class _BoundedLoader(_BoundedComposer, CParser, _BoundedConstructor, Resolver):  # type: ignore[misc]
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            _BoundedConstructor.__init__(self)
            Resolver.__init__(self)

except ImportError:  # a PyYAML built without libyaml

    class _BoundedLoader(_BoundedComposer, _BoundedConstructor, yaml.SafeLoader):  # type: ignore[misc,no-redef]
        pass


def _line(event: Any) -> int | None:
    mark = getattr(event, "start_mark", None)
    return int(mark.line) + 1 if mark is not None else None


def _expanded_size(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded (memoized per node, so the
    count itself costs the size of the *composed* graph); a recursive alias is an
    error (it expands forever)."""
    memo: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            open_.discard(id(node))
            memo[id(node)] = 1 + sum(memo[id(c)] for c in _children(node))
            if memo[id(node)] > MAX_NODES:
                return memo[id(node)]
            continue
        if id(node) in memo:
            continue
        if id(node) in open_:
            raise _Limit(
                "an alias refers to a collection that contains it", int(node.start_mark.line) + 1
            )
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in memo)
    return memo[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _read_text(path: Path) -> str:
    file = str(path)
    try:
        raw = read_regular(path, MAX_DOCUMENT_BYTES)
    except FileTooLarge as exc:
        raise ManifestError(
            f"is {exc.size} bytes; a manifest may have at most {MAX_DOCUMENT_BYTES}", file=file
        ) from None
    except NotRegularFile as exc:
        raise ManifestError(str(exc.strerror), file=file) from None
    except OSError as exc:
        raise ManifestError(f"cannot read: {exc.strerror or exc}", file=file) from exc
    return decode_utf8(raw, file=file)


def decode_utf8(raw: bytes, *, file: str) -> str:
    """``raw`` as UTF-8; a ManifestError naming the line and column of a bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = byte_position(raw, exc.start)
        raise ManifestError(
            f"column {column}: byte 0x{raw[exc.start]:02x} is not UTF-8 (byte offset {exc.start})",
            file=file,
            line=line,
        ) from None


def load_yaml_bounded(path: Path) -> tuple[Any, yaml.Node | None]:
    """Parse one YAML file within the limits above: (data, node tree for line numbers)."""
    text = _read_text(path)
    if _bracket_depth(text) > MAX_DEPTH:
        # Checked before PyYAML sees the text: its scanner keeps a possible key per
        # open flow collection and rescans them on every token (quadratic in depth).
        raise ManifestError(
            f"nested deeper than {MAX_DEPTH} levels", file=str(path), line=_deep_line(text)
        )
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and (size := _expanded_size(node)) > MAX_NODES:
            raise _Limit(
                f"expands to more than {MAX_NODES} nodes through its aliases "
                f"({size} counted so far)",
                int(node.start_mark.line) + 1,
            )
        data = loader.construct_document(node) if node is not None else None
    except _Limit as exc:
        raise ManifestError(exc.message, file=str(path), line=exc.line) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ManifestError(f"not valid YAML: {exc}", file=str(path), line=line) from None
    finally:
        loader.dispose()
    return data, node


def load_json(raw: bytes, *, file: str) -> Any:
    """One JSON document from the bus within the same size, depth and key rules."""
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise ManifestError(
            f"is {len(raw)} bytes; a manifest may have at most {MAX_DOCUMENT_BYTES}", file=file
        )
    text = decode_utf8(raw, file=file)
    if _bracket_depth(text) > MAX_DEPTH and json_depth(text) > MAX_DEPTH:
        raise ManifestError(f"nested deeper than {MAX_DEPTH} levels", file=file)
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _Limit as exc:
        raise ManifestError(exc.message, file=file) from None
    except ValueError as exc:
        raise ManifestError(f"not valid JSON: {exc}", file=file) from None


def json_depth(text: str) -> int:
    """Deepest bracket nesting outside strings (before json's recursive parser runs):
    the one check of every reader of JSON it does not trust."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


_BRACKET = re.compile(r"[\[\]{}]")


def _bracket_depth(text: str) -> int:
    """Deepest nesting of flow brackets, quotes ignored (conservative: brackets inside
    strings count too, and a manifest never nests anywhere near the limit)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(text):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


def _deep_line(text: str) -> int:
    """The line on which the bracket nesting passes MAX_DEPTH."""
    depth = 0
    for match in _BRACKET.finditer(text):
        depth = depth + 1 if match.group() in "[{" else max(0, depth - 1)
        if depth > MAX_DEPTH:
            return text.count("\n", 0, match.start()) + 1
    return 1


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Limit(f"duplicate key {key!r}", None)
        out[key] = value
    return out


def npz_headers(z: Any) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Each ``.npy`` member of the open npz ``z`` (``np.load``'s NpzFile) by its array
    name: its shape and dtype, read from its header, nothing decompressed past it."""
    headers: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
    for member in z.zip.namelist():
        with z.zip.open(member) as fh:
            version = np.lib.format.read_magic(fh)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(fh)
        headers[member.removesuffix(".npy")] = (tuple(shape), dtype)
    return headers
