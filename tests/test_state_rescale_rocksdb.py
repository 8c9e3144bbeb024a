"""The rescale matrix of test_state_rescale.py on the RocksDB backend (a separate file: every subtask is a database
on disk, so this is the slow half)."""

from __future__ import annotations

import pytest
from test_state_rescale import CASES, check_rescale


@pytest.mark.parametrize("maxp,p,p2,nkeys", CASES)
def test_rescale_rocksdb(maxp, p, p2, nkeys, tmp_path):
    check_rescale("rocksdb", maxp, p, p2, nkeys, tmp_path)
