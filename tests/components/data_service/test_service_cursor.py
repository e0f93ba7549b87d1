"""Stream cursors: round trip, tamper detection, foreign streams."""

import dataclasses

import pytest
from gemrec.components.data_service.cursor import Cursor, CursorError, StreamKey, dataset_tag
from hypothesis import given
from hypothesis import strategies as st

KEY = StreamKey(dataset_tag("sha256:abc"), "train", 1, 4, 256, 1024, 3, 42, True, 512.0)


def test_round_trip():
    cursor = Cursor(KEY, 17)
    assert Cursor.decode(cursor.encode()) == cursor
    cursor.check_matches(KEY, num_steps=17)


@given(st.binary(max_size=120))
def test_random_bytes_are_rejected(data):
    with pytest.raises(CursorError, match="malformed"):
        Cursor.decode(data)


def test_any_flipped_bit_is_rejected():
    data = Cursor(KEY, 5).encode()
    for i in range(len(data)):
        edited = bytearray(data)
        edited[i] ^= 0x10
        with pytest.raises(CursorError):
            Cursor.decode(bytes(edited))
    with pytest.raises(CursorError, match="malformed"):
        Cursor.decode(data[:-1])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rank", 2, "rank=1"),
        ("world_size", 2, "world_size=4"),
        ("epoch", 4, "epoch=3"),
        ("seed", 7, "seed=42"),
        ("split", "eval", "split='train'"),
        ("max_seq_len", 256, "max_seq_len=1024"),
        ("dataset", dataset_tag("sha256:other"), "another dataset"),
    ],
)
def test_foreign_cursor_names_the_mismatch(field, value, message):
    cursor = Cursor.decode(Cursor(KEY, 3).encode())
    with pytest.raises(CursorError, match=message):
        cursor.check_matches(dataclasses.replace(KEY, **{field: value}), num_steps=10)


def test_position_beyond_epoch_is_rejected():
    with pytest.raises(CursorError, match="outside the epoch"):
        Cursor(KEY, 11).check_matches(KEY, num_steps=10)
