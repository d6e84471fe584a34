"""flagella.cni.cnijson against the json module: the same values from the
same documents, the same text from the same values, and whatever json
refuses refused too (hypothesis, on JSON-shaped and arbitrary text)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flagella.cni import cnijson

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=1000, deadline=None)
@given(value=values)
def test_dumps_is_json_dumps_and_loads_reads_it_back(value: Any) -> None:
    text = cnijson.dumps(value)
    assert text == json.dumps(value)
    assert cnijson.loads(text) == json.loads(text)
    assert cnijson.loads(text.encode()) == value


@settings(max_examples=500, deadline=None)
@given(value=values, indent=st.sampled_from([None, 0, 2, "\t"]), ascii_only=st.booleans())
def test_loads_reads_json_in_any_layout(value: Any, indent: Any, ascii_only: bool) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert cnijson.loads(text) == value
    assert cnijson.loads(f" \n\t{text}\r\n ") == value


def outcome(parse: Any, text: str) -> tuple[str, Any]:
    try:
        value = parse(text)
    except ValueError:
        return ("error", None)
    except RecursionError:
        return ("error", None)
    return ("ok", json.dumps(value, sort_keys=True))  # NaN-safe comparison


json_alphabet = st.sampled_from(list('{}[]:,"\\ \t\n-+.0123456789eEtrufalsnNIiybu/\x01é'))


@settings(max_examples=3000, deadline=None)
@given(text=st.text(json_alphabet, max_size=30))
def test_same_verdict_as_json_on_near_json_text(text: str) -> None:
    assert outcome(cnijson.loads, text) == outcome(json.loads, text)


@settings(max_examples=1000, deadline=None)
@given(text=st.text(max_size=40))
def test_same_verdict_as_json_on_any_text(text: str) -> None:
    assert outcome(cnijson.loads, text) == outcome(json.loads, text)


@pytest.mark.parametrize(
    "text",
    ['"\\ud83d\\ude00"', '"\\ud800"', '"\\ud800\\u0041"', '"\\udc00\\ud800"', '"a\\/b\\b\\f"'],
)
def test_surrogates_and_escapes(text: str) -> None:
    assert cnijson.loads(text) == json.loads(text)


def test_specials_and_numbers() -> None:
    assert math.isnan(cnijson.loads("NaN"))
    assert cnijson.loads("[Infinity, -Infinity, -0, 1E+2, 0.5e-1, 12345678901234567890]") == [
        math.inf,
        -math.inf,
        0,
        100.0,
        0.05,
        12345678901234567890,
    ]
    assert cnijson.dumps([math.nan, math.inf, -math.inf, (1, 2)]) == json.dumps(
        [math.nan, math.inf, -math.inf, (1, 2)]
    )
    assert cnijson.dumps({3: "a", 2.5: "b", True: "c", None: "d"}) == json.dumps(
        {3: "a", 2.5: "b", True: "c", None: "d"}
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "{not json",
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        ("", "Expecting value: line 1 column 1 (char 0)"),
        ('{"a": 1,\n "b" 2}', "Expecting ':' delimiter: line 2 column 6 (char 14)"),
        ("[1] x", "Extra data: line 1 column 5 (char 4)"),
    ],
)
def test_error_messages_match_json(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r".") as ours:
        cnijson.loads(text)
    with pytest.raises(ValueError, match=r".") as theirs:
        json.loads(text)
    assert str(ours.value) == str(theirs.value) == message


def test_utf8_bytes_with_and_without_bom() -> None:
    assert cnijson.loads('{"é": "ü"}'.encode()) == {"é": "ü"}
    assert cnijson.loads(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    with pytest.raises(UnicodeDecodeError):
        cnijson.loads(b'{"a": "\xff"}')


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    with pytest.raises(ValueError, match="Nesting too deep"):
        cnijson.loads("[" * 100_000)


def test_unserializable_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        cnijson.dumps({"a": object()})
    with pytest.raises(TypeError):
        cnijson.dumps({(1, 2): "tuple key"})
