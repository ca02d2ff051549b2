"""embstore.hash_keys: string features to int64 keys, stable (pinned values,
checked against the xxhash package's XXH3-64), the same from every
container, collision-free on 10M distinct strings, and refusing bad input."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

import embstore

WORDS = ["", "a", "user:42", "héllo", "日本語", "🙂 emoji", "x" * 300]


def signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """splitmix64's finalizer, from its published constants."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def oracle(value: bytes, salt: int) -> int:
    """The documented key: XXH3-64 of the bytes (the xxhash package's), and
    under a salt s != 0, mix64(h ^ mix64(s))."""
    h = xxhash.xxh3_64_intdigest(value)
    return signed(h if salt == 0 else mix64(h ^ mix64(salt)))


def test_pinned_values() -> None:
    """These keys may never change: models store them."""
    assert embstore.hash_keys(["", "a", "user:42", "héllo", "日本語"]).tolist() == [
        3244421341483603138,
        -1817709641818812897,
        -6935009037822888790,
        7657728615535385375,
        1296689438140682423,
    ]
    assert embstore.hash_keys(["a"], salt=1).tolist() == [oracle(b"a", 1)]


@pytest.mark.parametrize("salt", [0, 1, 12345, 2**64 - 1])
def test_equals_xxh3_64_of_the_utf8_bytes_then_the_salt(salt: int) -> None:
    got = embstore.hash_keys(WORDS, salt=salt)
    assert got.dtype == np.int64
    assert got.tolist() == [oracle(w.encode(), salt) for w in WORDS]


def test_every_container_gives_the_same_keys() -> None:
    want = embstore.hash_keys(WORDS).tolist()
    encoded = [w.encode() for w in WORDS]
    containers = [
        tuple(WORDS),
        np.array(WORDS),
        np.array(WORDS).astype(np.dtype("U400").newbyteorder(">")),
        np.array(encoded),  # S: trailing NULs are not part of a value
        np.array(WORDS, dtype=object),
        np.array(encoded, dtype=object),
        np.array(WORDS, dtype=np.dtypes.StringDType()),
        encoded,
    ]
    for c in containers:
        assert embstore.hash_keys(c).tolist() == want, type(c)


def test_array_shape_is_kept() -> None:
    a = np.array([["u1", "u2", "u3"], ["i1", "i2", "i3"]])
    k = embstore.hash_keys(a)
    assert k.shape == (2, 3)
    assert k.ravel().tolist() == embstore.hash_keys(a.ravel().tolist()).tolist()
    assert embstore.hash_keys(a[:, ::2]).tolist() == [
        embstore.hash_keys(["u1", "u3"]).tolist(),
        embstore.hash_keys(["i1", "i3"]).tolist(),
    ]
    assert embstore.hash_keys([]).shape == (0,)


def test_salts_separate_features() -> None:
    user = embstore.hash_keys(["5"], salt=1)
    item = embstore.hash_keys(["5"], salt=2)
    assert user[0] != item[0]


def test_short_strings_under_different_salts_never_share_a_key() -> None:
    """Ids of 1 to 3 characters (a Frappe-like dataset's user and item ids)
    under one salt per field: 26 fields x 1,000 ids, and every 1- and
    2-byte value under salts 0..63 -- all keys distinct (XXH3's seed gave
    19,440 collisions of 26,000 in the first case)."""
    ids = [str(i) for i in range(1000)]
    keys = np.concatenate([embstore.hash_keys(ids, salt=s) for s in range(26)])
    assert np.unique(keys).size == keys.size
    short = [bytes([a]) for a in range(256)] + [
        bytes([a, b]) for a in range(256) for b in range(256)
    ]
    keys = np.concatenate([embstore.hash_keys(short, salt=s) for s in range(64)])
    assert np.unique(keys).size == keys.size


@pytest.mark.slow
def test_no_collision_on_10m_distinct_strings() -> None:
    values = np.arange(10_000_000).astype("U8")  # "0" ... "9999999"
    keys = embstore.hash_keys(values)
    ordered = np.sort(keys)
    assert (ordered[1:] != ordered[:-1]).all(), "two distinct strings share a key"
    assert keys[123_456] == embstore.hash_keys(["123456"])[0]


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ("abc", TypeError, "values: expected an array or a list of str/bytes, got one str"),
        (b"abc", TypeError, "got one bytes"),
        (["a", 5], TypeError, "values: expected str or bytes values, got int at index 1"),
        ([None], TypeError, "got NoneType at index 0"),
        (np.arange(3), TypeError, "values: expected str or bytes values .* got dtype int64"),
        (np.array(["a", 1.5], dtype=object), TypeError, "got float at index 1"),
        (["ok", "\ud800"], ValueError, "values: value 1 is not valid UTF-8 text"),
        (5, TypeError, "values: expected an array or a list of str/bytes, got int"),
    ],
)
def test_bad_values_are_refused(values: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        embstore.hash_keys(values)


@pytest.mark.parametrize("salt", [-1, 2**64, 1.5, True])
def test_bad_salt_is_refused(salt: object) -> None:
    with pytest.raises((TypeError, ValueError), match="salt"):
        embstore.hash_keys(["a"], salt=salt)  # type: ignore[arg-type]
