"""JSON input of ingest: JSON lines, or one JSON array of objects, parsed record by record.

A record that is not a row (invalid JSON, nested deeper than MAX_JSON_DEPTH, not an object, a mapped key twice)
is returned as {"__reason__": ..., "__raw__": its text} for ingest to quarantine; only a JSON array that cannot
be parsed as an array raises json.JSONDecodeError (the file is unreadable). Control characters inside strings
are accepted raw as well as escaped (strict=False), so a raw NUL or tab reads like "\\u0000" or "\\t" and text is
normalised the same way in every format (stages/ingest.normalise_text).
"""
from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator

# Nesting levels a record may have (a pair needs 2). Python's parser recurses once per level and fails at a depth
# that depends on the caller's stack; a fixed cap makes the outcome a function of the record alone.
MAX_JSON_DEPTH = 128
TOO_DEEP = "json_too_deep"
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class _KeysRepeated(dict):
    """A JSON object that named some key twice (json keeps the last value silently); `keys_in_order` lists all."""

    keys_in_order: list[str]


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    value = dict(pairs)
    if len(value) < len(pairs):
        value = _KeysRepeated(value)
        value.keys_in_order = [key for key, _ in pairs]
    return value


_JSON = json.JSONDecoder(object_pairs_hook=_json_object, strict=False)


def too_deep(text: str, most: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON `text` nests more than `most` arrays/objects (brackets inside strings do not count).
    Linear, and a plain count for the usual record that holds fewer brackets than `most`."""
    if text.count("[") + text.count("{") <= most:
        return False
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > most:
            return True
    return False


def brackets_balance(text: str) -> bool:
    """Whether `text` closes as many arrays and objects as it opens (brackets inside strings do not count)."""
    outside = _STRING.sub("", text)
    return outside.count("[") + outside.count("{") == outside.count("]") + outside.count("}")


def jsonl_records(lines: Iterable[str], columns: list[str]) -> Iterator[dict]:
    """One record per line (a blank line too, so every line keeps its index)."""
    return (_jsonl_record(line.strip(), columns) for line in lines)


def _jsonl_record(line: str, columns: list[str]) -> dict:
    if not line:
        return {"__reason__": "blank_line"}
    if not is_encodable(line):  # the undecodable bytes kept as \xNN escapes
        return {"__reason__": "invalid_utf8",
                "__raw__": line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")}
    if too_deep(line):
        return {"__reason__": TOO_DEEP, "__raw__": line}
    try:
        return json_record(_JSON.decode(line), line, columns)
    except json.JSONDecodeError:
        return {"__reason__": "invalid_json", "__raw__": line}


def json_record(value: object, raw: str, columns: list[str]) -> dict:
    """The row dict of one parsed JSON value, or the reason it is not one (with its raw text kept)."""
    if not isinstance(value, dict):
        return {"__reason__": "not_an_object", "__raw__": raw}
    if isinstance(value, _KeysRepeated):
        twice = [c for c in columns if value.keys_in_order.count(c) > 1]
        if twice:  # which value is the text is a guess: the row is quarantined (the file's first object: an error)
            return {"__reason__": "repeated_key:" + ",".join(twice), "__raw__": raw, "__keys__": value.keys_in_order}
    return value


def json_array_records(text: io.TextIOBase, columns: list[str]) -> Iterator[dict]:
    """The elements of a file holding one JSON array, as records (memory: one element)."""
    for value, raw in json_array_items(text):
        if value is _SKIPPED or too_deep(raw):  # parsed or not, the same cap as a JSON line's
            yield {"__reason__": TOO_DEEP, "__raw__": raw}
        else:
            yield json_record(value, raw, columns)


_SKIPPED = object()  # an element too deep for the parser: found by its brackets, not parsed


def json_array_items(text: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator[tuple[object, str]]:
    """(value, its JSON text) per element of the top-level array; raises JSONDecodeError where it is invalid.
    An element nested too deep for the parser is yielded as (_SKIPPED, its text)."""
    decoder, buf, pos = _JSON, "", 0

    def next_char() -> str:  # the next non-blank character, reading on as needed; "" at the end of the file
        nonlocal buf, pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return buf[pos]
            buf, pos = text.read(chunk_chars), 0
            if not buf:
                return ""

    if next_char() != "[":
        raise json.JSONDecodeError("expected '['", buf, pos)
    pos += 1
    if next_char() == "]":
        pos += 1
    else:
        while True:
            next_char()
            while True:  # an element may span chunks; a number at the chunk's end may go on in the next
                more = ""
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or not (more := text.read(chunk_chars)):
                        break
                except json.JSONDecodeError:
                    if not (more := text.read(chunk_chars)):
                        raise
                except RecursionError:
                    buf, pos, end = _container_end(text, buf, pos, chunk_chars)
                    value = _SKIPPED
                    break
                buf, pos = buf[pos:] + more, 0
            yield value, buf[pos:end]
            pos = end
            sep = next_char()
            pos += 1
            if sep == "]":
                break
            if sep != ",":
                raise json.JSONDecodeError("expected ',' or ']' after an array element", buf, pos - 1)
    if next_char():
        raise json.JSONDecodeError("extra data after the JSON array", buf, pos)


def _container_end(text: io.TextIOBase, buf: str, pos: int, chunk_chars: int) -> tuple[str, int, int]:
    """(buf, pos, end) with buf[pos:end] the array or object starting at buf[pos], found by counting its brackets
    outside strings (no recursion), reading on as needed."""
    pieces, depth, in_string, escape, i = [buf[pos:]], 0, False, False, 0
    chunk = pieces[0]
    while True:
        for i, ch in enumerate(chunk):
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
                if depth == 0:
                    element_and_rest = "".join(pieces)
                    return element_and_rest, 0, len(element_and_rest) - len(chunk) + i + 1
        chunk = text.read(chunk_chars)
        if not chunk:
            raise json.JSONDecodeError("an array element is not closed before the end of the file", buf, pos)
        pieces.append(chunk)


def is_encodable(text: str) -> bool:
    """False when `text` holds lone surrogates (undecodable bytes kept by surrogateescape, or a JSON
    "\\ud800" escape): such text cannot be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
