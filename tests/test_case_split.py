"""`make test`'s two legs share out each parametrized test's cases (tests/conftest.py's --case-split): every case in
exactly one share, every test in each."""

import pytest

from tests.conftest import case_share, parent_id, parse_case_split

IDS = ["a.py::t[0]", "a.py::t[1]", "a.py::t[2]", "a.py::u", "b.py::t[x]", "b.py::v[0]", "b.py::v[1]",
       "b.py::w[big]", "b.py::w[small]"]
SLOW = [False] * 7 + [True, False]


def _share(k, n, always=None):
    keep = case_share(IDS, always or [False] * len(IDS), k, n)
    return [i for i, kept in zip(IDS, keep) if kept]


def test_two_shares_cover_every_case_once_and_every_test_twice():
    even, odd = _share(0, 2), _share(1, 2)
    assert even == ["a.py::t[0]", "a.py::t[2]", "a.py::u", "b.py::t[x]", "b.py::v[0]", "b.py::w[big]"]
    # a test with one case (unparametrized, or one id) runs in both shares
    assert odd == ["a.py::t[1]", "a.py::u", "b.py::t[x]", "b.py::v[1]", "b.py::w[small]"]
    assert set(even) | set(odd) == set(IDS)
    tests = lambda ids: set(map(parent_id, ids))  # noqa: E731
    assert tests(even) == tests(odd) == tests(IDS)


def test_more_shares_than_cases_keep_the_last():
    assert _share(2, 3) == ["a.py::t[2]", "a.py::u", "b.py::t[x]", "b.py::v[1]", "b.py::w[small]"]


def test_always_kept_cases_stay_outside_the_count():
    even, odd = _share(0, 2, SLOW), _share(1, 2, SLOW)
    # w[big] is kept in both, and w[small], now w's only counted case, in both too
    assert "b.py::w[big]" in even and "b.py::w[big]" in odd
    assert "b.py::w[small]" in even and "b.py::w[small]" in odd


@pytest.mark.parametrize("spec", ["1", "2/2", "-1/2", "a/b", "1/0", ""])
def test_bad_spec_names_the_option(spec):
    with pytest.raises(pytest.UsageError, match="--case-split"):
        parse_case_split(spec)


def test_spec():
    assert parse_case_split("1/2") == (1, 2)
