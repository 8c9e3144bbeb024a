"""Remake the savepoints of older Flink versions in tests/flink/fixtures/versions/ (see README.md). Not run in CI.

    python tests/flink/generate_version_fixtures.py [VERSION ...]     (every version of VERSION_FIXTURES by default)
    python tests/flink/generate_version_fixtures.py --check-export [VERSION ...]

`--check-export` writes nothing: it imports each committed fixture into keygroups, exports it back with
`keygroups.flink.export_savepoint(..., like=<the fixture>)` and has the Flink version that wrote it restore the export
at one more subtask, which must restore exactly the fixture's expected.txt.

For each Flink version it downloads that `apache-flink-libraries` wheel (`pip download`, into a cache directory under
the system temp dir, or KEYGROUPS_FLINK_LIBS_CACHE), keeps the jars of its `pyflink/lib`, compiles VersionsJob.java
against them and runs it on that Flink's MiniCluster with Java 17; the same Flink then restores each savepoint at one
more subtask and compares everything it restored with expected.txt before the fixture is kept. Each fixture directory
`versions/<flink version>/<variant>/` holds `savepoint/` (what Flink wrote) and `expected.txt` (every entry, timer and
operator-state element it holds, one canonical line each, as tests/flink/README.md describes).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from keygroups.flink import export_savepoint, import_savepoint, read_savepoint

HERE = pathlib.Path(__file__).parent
SOURCE = HERE / "VersionsJob.java"
TARGET = HERE / "fixtures" / "versions"
KEYS = 10

# Java 17 runs Flink 1.15 to 1.17 only with these (checked: 1.17 fails in ClosureCleaner without them, 1.18 runs
# without; Flink 1.18+ passes the same list in env.java.opts.all): they reach into java.base by reflection.
ADD_OPENS = [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in (
    "java.lang", "java.lang.reflect", "java.io", "java.net", "java.nio", "sun.nio.ch", "java.text", "java.time",
    "java.util", "java.util.concurrent", "java.util.concurrent.atomic", "java.util.concurrent.locks")]


@dataclasses.dataclass(frozen=True)
class VersionFixture:
    """One savepoint of VersionsJob: the Flink version writing it and the job's parameters (they name it)."""

    flink: str                # an apache-flink-libraries version, e.g. "1.15.4"
    parallelism: int = 2
    max_parallelism: int = 128
    backend: str = "hashmap"  # hashmap | rocksdb
    inline: bool = False      # every chunk inlined in _metadata, or each in a file of its own
    compression: bool = False

    @property
    def name(self) -> str:
        return (f"p{self.parallelism}-mp{self.max_parallelism}-{self.backend}-"
                f"{'inline' if self.inline else 'files'}-{'snappy' if self.compression else 'plain'}")

    @property
    def directory(self) -> pathlib.Path:
        return TARGET / self.flink / self.name


#: A release of each Flink minor version 1.15 to 2.2 (2.3 is tests/flink/fixtures/, written by SavepointJob.java),
#: each a heap (hashmap) savepoint; 1.15 also with RocksDB and with snapshot compression, 1.16 with RocksDB and a max
#: parallelism above 128 (2-byte key-group prefixes), 1.19 inlined in _metadata and with compression (operator state
#: is compressed too from 1.18, operator state header version 6; but Flink 1.18.1 fails to restore its own
#: compressed operator state at another parallelism, "invalid stream header", so the checked fixture is 1.19's).
VERSION_FIXTURES = [
    VersionFixture("1.15.4"),
    VersionFixture("1.15.4", backend="rocksdb"),
    VersionFixture("1.15.4", compression=True),
    VersionFixture("1.16.3"),
    VersionFixture("1.16.3", parallelism=3, max_parallelism=256, backend="rocksdb"),
    VersionFixture("1.17.2"),
    VersionFixture("1.18.1"),
    VersionFixture("1.19.3", inline=True),
    VersionFixture("1.19.3", compression=True),
    VersionFixture("1.20.3"),
    VersionFixture("2.0.1"),
    VersionFixture("2.1.1"),
    VersionFixture("2.2.0"),
]


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KEYGROUPS_FLINK_LIBS_CACHE",
                                       pathlib.Path(tempfile.gettempdir()) / "keygroups-flink-libs"))


def flink_lib(version: str) -> pathlib.Path:
    """The jars of apache-flink-libraries `version` (flink-dist, log4j, and the shaded ZooKeeper that Flink 1.15's
    streaming runtime needs), downloaded once into the cache."""
    lib = cache_dir() / version / "lib"
    if list(lib.glob("flink-dist-*.jar")):
        return lib
    download = pathlib.Path(tempfile.mkdtemp(prefix="keygroups-flink-wheel-"))
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(download), f"apache-flink-libraries=={version}"], check=True)
        (wheel,) = download.glob("*.whl")
        staging = lib.with_name("lib.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                name = member.rsplit("/", 1)[-1]
                if member.startswith("pyflink/lib/") and name.startswith(("flink-dist", "log4j", "flink-shaded-zoo")):
                    (staging / name).write_bytes(z.read(member))
        staging.rename(lib)
    finally:
        shutil.rmtree(download, ignore_errors=True)
    return lib


def build(version: str) -> str:
    """Compile VersionsJob against Flink `version`; the classpath to run it with."""
    lib = flink_lib(version)
    jars = sorted(str(p) for p in lib.glob("*.jar"))
    classes = cache_dir() / version / "classes"
    shutil.rmtree(classes, ignore_errors=True)
    subprocess.run(["javac", "-nowarn", "-d", str(classes), "-cp", os.pathsep.join(jars), str(SOURCE)], check=True)
    return os.pathsep.join([str(classes), *jars])


def _run(classpath: str, args: list) -> subprocess.CompletedProcess:
    cmd = ["java", "-Xmx768m", "-XX:+UseSerialGC", *ADD_OPENS, "-cp", classpath, "VersionsJob", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def check(fixture: VersionFixture, savepoint: pathlib.Path, expected: pathlib.Path, classpath: str, what: str) -> None:
    """Flink restores `savepoint` at one more subtask and must restore exactly `expected`."""
    parallelism = min(fixture.parallelism + 1, fixture.max_parallelism)
    with tempfile.TemporaryDirectory() as dump:
        r = _run(classpath, ["check", savepoint, parallelism, expected, dump])
    if r.returncode != 0:
        raise SystemExit(f"Flink {fixture.flink} {fixture.name}: Flink does not restore {what} ({r.returncode}):\n"
                         f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}")


def write(fixture: VersionFixture, classpath: str) -> None:
    """Write the savepoint, have the same Flink restore it at one more subtask and compare everything it restored
    with expected.txt, and only then keep it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "out"
        r = _run(classpath, ["write", out, fixture.parallelism, fixture.max_parallelism,
                             str(fixture.compression).lower(), KEYS, fixture.backend, str(fixture.inline).lower()])
        if r.returncode != 0:
            raise SystemExit(f"Flink {fixture.flink} {fixture.name}: the writer failed ({r.returncode}):\n"
                             f"{r.stdout[-2000:]}\n{r.stderr[-6000:]}")
        check(fixture, out / "savepoint", out / "expected.txt", classpath, "what it wrote")
        shutil.rmtree(fixture.directory, ignore_errors=True)
        fixture.directory.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, fixture.directory)
    size = sum(p.stat().st_size for p in fixture.directory.rglob("*") if p.is_file())
    print(f"{fixture.flink}/{fixture.name}: {size} bytes")


def check_export(fixture: VersionFixture, classpath: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        flink = read_savepoint(fixture.directory / "savepoint")
        import_savepoint(flink, tmp, "imported", uid="keyed")
        export_savepoint(tmp, pathlib.Path(tmp) / "exported", uid="keyed", savepoint="imported", like=flink)
        check(fixture, pathlib.Path(tmp) / "exported", fixture.directory / "expected.txt", classpath,
              "keygroups' export of it")
    print(f"{fixture.flink}/{fixture.name}: Flink {fixture.flink} restores keygroups' export")


def main() -> None:
    args = sys.argv[1:]
    exports = "--check-export" in args
    only = set(args) - {"--check-export"}
    for version in dict.fromkeys(f.flink for f in VERSION_FIXTURES):
        if only and version not in only:
            continue
        classpath = build(version)
        for fixture in VERSION_FIXTURES:
            if fixture.flink == version:
                (check_export if exports else write)(fixture, classpath)


if __name__ == "__main__":
    main()
