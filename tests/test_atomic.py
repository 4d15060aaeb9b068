"""domainfm.atomic: outputs appear whole or not at all, and a failed write names the target the
user asked for, never the hidden temporary beside it."""
from __future__ import annotations

import errno

import pytest

from domainfm.atomic import TMP_MARK, atomic_path, atomic_paths


def test_a_failed_write_names_the_target_not_the_temporary(tmp_path):
    target = tmp_path / "map.png"
    with pytest.raises(OSError) as info:
        with atomic_path(target, suffix=".png") as tmp:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    assert info.value.filename == str(target) and info.value.errno == errno.ENOSPC
    assert TMP_MARK not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_several_outputs_appear_together_or_not_at_all(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.png"
    with pytest.raises(ValueError, match="second part failed"):
        with atomic_paths(a, None, b) as (ta, none, tb):
            assert none is None and ta.suffix == ".csv" and tb.suffix == ".png"
            ta.write_text("1")
            raise ValueError("second part failed")
    assert list(tmp_path.iterdir()) == []
    with atomic_paths(a, b) as (ta, tb):
        ta.write_text("1")
        tb.write_text("2")
    assert a.read_text() == "1" and b.read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.png"]
