"""Remake the committed Flink savepoint fixtures in tests/flink/fixtures/ with a real Flink 2.3 (see README.md).

    python tests/flink/generate_fixtures.py [NAME ...]     (all of them by default)

Each fixture directory holds `savepoint/` (what Flink wrote) and `expected.txt` (every entry, timer and operator
state element it holds, one canonical line each); the checking job restores each one before it is kept.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

from flink_harness import FIXTURE_SET, FIXTURES, check_savepoint, write_savepoint  # noqa: E402


def main() -> None:
    FIXTURES.mkdir(exist_ok=True)
    only = set(sys.argv[1:])
    for fixture in FIXTURE_SET:
        if only and fixture.name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "out"
            savepoint = write_savepoint(out, fixture)
            ok, report = check_savepoint(savepoint, fixture.parallelism, fixture.key_type, out / "expected.txt",
                                         pathlib.Path(tmp) / "dump")
            if not ok:
                raise SystemExit(f"{fixture.name}: Flink does not restore what it wrote:\n{report}")
            target = FIXTURES / fixture.name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(out, target)
            size = sum(p.stat().st_size for p in (target / "savepoint").iterdir())
            print(f"{fixture.name}: {size} bytes")


if __name__ == "__main__":
    main()
