"""JSON (RFC 8259) for flagella-cni: loads and dumps with the standard json
module's results, without its import. `import json` pulls in re (its
scanner's patterns), enum, functools and collections: about a third of
what the plugin costs to start. Network configurations and results are
small, so a plain recursive-descent parser does. tests/unit/test_cni_json.py
checks both directions against the json module."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
# The constants json.loads takes besides the RFC's.
_NAMES: dict[str, Any] = {
    "true": True,
    "false": False,
    "null": None,
    "NaN": float("nan"),
    "Infinity": float("inf"),
    "-Infinity": float("-inf"),
}
# Nesting deeper than this is refused (two frames a level; json itself hits
# RecursionError near 1000 levels). Network configurations nest a few levels.
MAX_DEPTH = 200


class JSONDecodeError(ValueError):
    def __init__(self, msg: str, doc: str, pos: int) -> None:
        line = doc.count("\n", 0, pos) + 1
        column = pos - doc.rfind("\n", 0, pos)
        super().__init__(f"{msg}: line {line} column {column} (char {pos})")
        self.msg = msg
        self.pos = pos


BOM = b"\xef\xbb\xbf"


def text_of(data: bytes) -> str:
    """UTF-8 bytes as text, one leading BOM dropped: what decoding with
    "utf-8-sig" gives, without importing that codec (the utf-8 one is
    built in)."""
    return data.removeprefix(BOM).decode("utf-8")


def loads(data: str | bytes) -> Any:
    """A JSON document (bytes as UTF-8, a leading BOM allowed there, as
    json.loads does)."""
    if isinstance(data, (bytes, bytearray)):
        text = text_of(bytes(data))
    else:
        text = data
        if text.startswith("\ufeff"):
            raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    parser = _Parser(text)
    value = parser.value(0)
    parser.skip()
    if parser.pos != len(text):
        raise JSONDecodeError("Extra data", text, parser.pos)
    return value


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, msg: str, pos: int | None = None) -> JSONDecodeError:
        return JSONDecodeError(msg, self.text, self.pos if pos is None else pos)

    def skip(self) -> None:
        text, pos, end = self.text, self.pos, len(self.text)
        while pos < end and text[pos] in _WHITESPACE:
            pos += 1
        self.pos = pos

    def value(self, depth: int) -> Any:
        self.skip()
        text, pos = self.text, self.pos
        if pos >= len(text):
            raise self.fail("Expecting value")
        c = text[pos]
        if c == '"':
            self.pos = pos + 1
            return self.string()
        if c in "{[":
            if depth >= MAX_DEPTH:
                raise self.fail("Nesting too deep")
            self.pos = pos + 1
            return self.obj(depth + 1) if c == "{" else self.array(depth + 1)
        if c == "-" or c in _DIGITS:
            if text.startswith("-Infinity", pos):
                self.pos = pos + len("-Infinity")
                return _NAMES["-Infinity"]
            return self.number()
        for name, constant in _NAMES.items():
            if text.startswith(name, pos):
                self.pos = pos + len(name)
                return constant
        raise self.fail("Expecting value")

    def number(self) -> int | float:
        text, start, end = self.text, self.pos, len(self.text)
        pos = start
        if text[pos] == "-":
            pos += 1
        if pos < end and text[pos] == "0":
            pos += 1
        elif pos < end and text[pos] in "123456789":
            while pos < end and text[pos] in _DIGITS:
                pos += 1
        else:
            raise self.fail("Expecting value", start)
        integer = True
        if pos + 1 < end and text[pos] == "." and text[pos + 1] in _DIGITS:
            integer = False
            pos += 2
            while pos < end and text[pos] in _DIGITS:
                pos += 1
        if pos < end and text[pos] in "eE":
            exp = pos + 1
            if exp < end and text[exp] in "+-":
                exp += 1
            if exp < end and text[exp] in _DIGITS:
                integer = False
                pos = exp
                while pos < end and text[pos] in _DIGITS:
                    pos += 1
        self.pos = pos
        return int(text[start:pos]) if integer else float(text[start:pos])

    def string(self) -> str:
        text, pos, end = self.text, self.pos, len(self.text)
        begin = pos - 1
        parts: list[str] = []
        while True:
            quote = text.find('"', pos)
            backslash = text.find("\\", pos, quote if quote >= 0 else end)
            stop = backslash if backslash >= 0 else quote
            if stop < 0:
                raise self.fail("Unterminated string starting at", begin)
            chunk = text[pos:stop]
            for i, ch in enumerate(chunk):
                if ch < " ":
                    raise self.fail("Invalid control character at", pos + i)
            parts.append(chunk)
            if stop == quote:
                self.pos = quote + 1
                return "".join(parts)
            pos = stop + 1
            if pos >= end:
                raise self.fail("Unterminated string starting at", begin)
            esc = text[pos]
            if esc == "u":
                code = self._hex4(pos + 1)
                pos += 5
                if 0xD800 <= code <= 0xDBFF and text.startswith("\\u", pos):
                    low = self._hex4(pos + 2)
                    if 0xDC00 <= low <= 0xDFFF:
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                        pos += 6
                parts.append(chr(code))
            elif esc in _ESCAPES:
                parts.append(_ESCAPES[esc])
                pos += 1
            else:
                raise self.fail("Invalid \\escape", pos - 1)

    def _hex4(self, pos: int) -> int:
        digits = self.text[pos : pos + 4]
        if len(digits) != 4 or any(d not in _HEX for d in digits):
            raise self.fail("Invalid \\uXXXX escape", pos - 1)
        return int(digits, 16)

    def obj(self, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.skip()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            self.skip()
            if not self.text.startswith('"', self.pos):
                raise self.fail("Expecting property name enclosed in double quotes")
            self.pos += 1
            key = self.string()
            self.skip()
            if not self.text.startswith(":", self.pos):
                raise self.fail("Expecting ':' delimiter")
            self.pos += 1
            out[key] = self.value(depth)
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                continue
            if self.text.startswith("}", self.pos):
                self.pos += 1
                return out
            raise self.fail("Expecting ',' delimiter")

    def array(self, depth: int) -> list[Any]:
        out: list[Any] = []
        self.skip()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return out
        while True:
            out.append(self.value(depth))
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                continue
            if self.text.startswith("]", self.pos):
                self.pos += 1
                return out
            raise self.fail("Expecting ',' delimiter")


def dumps(value: Any) -> str:
    """json.dumps(value) with its defaults: ASCII only, ", " and ": "."""
    out: list[str] = []
    _dump(value, out)
    return "".join(out)


def _dump(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(_quote(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        if value != value:  # noqa: PLR0124 - NaN, without importing math
            out.append("NaN")
        elif value in (float("inf"), float("-inf")):
            out.append("Infinity" if value > 0 else "-Infinity")
        else:
            out.append(float.__repr__(value))
    elif isinstance(value, dict):
        if not value:
            out.append("{}")
            return
        out.append("{")
        first = True
        for key, item in value.items():
            if not first:
                out.append(", ")
            first = False
            out.append(_quote(_key(key)))
            out.append(": ")
            _dump(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append("[]")
            return
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(", ")
            _dump(item, out)
        out.append("]")
    else:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _key(key: Any) -> str:
    """Dictionary keys as json.dumps turns them into strings."""
    if isinstance(key, str):
        return key
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, (int, float)):
        return dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _quote(text: str) -> str:
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    out = ['"']
    for ch in text:
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            code = ord(ch)
            if code > 0xFFFF:
                code -= 0x10000
                out.append(f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}")
            else:
                out.append(f"\\u{code:04x}")
    out.append('"')
    return "".join(out)
