"""``write_back_batches`` (a job's RocksDB write-back interval) is checked where the job is built and reaches each
subtask's RocksDB backend: through the runtime's spine (``JobOptions`` -> ``KeyedTaskSpec`` -> ``create_backend``),
run here by the local executor, no Spark."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pytest

from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime.batch import JobDriver, JobOptions
from keygroups.runtime.local import LocalExecutor
from keygroups.state import rocksdb as rocksdb_module
from spark_functions import KEY_TOTALS as OUT, Total


def _run(tmp_path, monkeypatch, batches, **options):
    """Run ``batches`` (lists of keys, each +1) through a RocksDB job; the write-back interval of every backend
    made (a spy on the real backend)."""
    made = []
    init = rocksdb_module.RocksDBKeyedStateBackend.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self.write_back_batches)

    storage = CheckpointStorage(str(tmp_path / "chk"))
    driver = JobDriver(JobOptions(name="j", key_columns=("k",), function=pickle.dumps(Total()), output_schema=OUT,
                                  max_parallelism=32, backend="rocksdb", local_dir=str(tmp_path / "local"),
                                  **options), storage, fence=False)
    with monkeypatch.context() as m:
        m.setattr(rocksdb_module.RocksDBKeyedStateBackend, "__init__", spy)
        for keys in batches:
            table = pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array([1] * len(keys), pa.int64())})
            driver.run(LocalExecutor(table), parallelism=2)
    driver.wait_for_retention()
    return made


def test_the_write_back_interval_reaches_every_rocksdb_subtask(tmp_path, monkeypatch):
    made = _run(tmp_path, monkeypatch, [list(range(50)), list(range(25, 75))], write_back_batches=2)
    assert made and set(made) == {2}
    made = _run(tmp_path / "default", monkeypatch, [list(range(10))])
    assert made and set(made) == {rocksdb_module.DEFAULT_WRITE_BACK_BATCHES}


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_a_bad_write_back_interval_is_refused_where_the_job_is_built(bad):
    with pytest.raises(ValueError, match="write_back_batches must be an int >= 1"):
        JobOptions(name="j", key_columns=("k",), function=pickle.dumps(Total()), output_schema=OUT,
                   max_parallelism=32, backend="rocksdb", write_back_batches=bad)
    from keygroups.spark import KeyedJob
    with pytest.raises(ValueError, match=f"write_back_batches must be an int >= 1.*got {bad!r}"):
        KeyedJob("j", "k", Total(), output_schema=OUT, max_parallelism=32, checkpoint_location="/tmp/unused",
                 backend="rocksdb", write_back_batches=bad)


def test_a_write_back_interval_for_the_heap_is_refused_naming_the_backend():
    with pytest.raises(ValueError, match="write_back_batches=2 applies to backend='rocksdb' only.*backend='heap'"):
        JobOptions(name="j", key_columns=("k",), function=pickle.dumps(Total()), output_schema=OUT,
                   max_parallelism=32, backend="heap", write_back_batches=2)
    from keygroups.spark import KeyedJob
    with pytest.raises(ValueError, match="write_back_batches=2 applies to backend='rocksdb' only.*backend='heap'"):
        KeyedJob("j", "k", Total(), output_schema=OUT, max_parallelism=32, checkpoint_location="/tmp/unused",
                 write_back_batches=2)


def test_keyed_job_hands_its_write_back_interval_to_the_runtime(tmp_path):
    from keygroups.spark import KeyedJob
    job = KeyedJob("j", "k", Total(), output_schema=OUT, max_parallelism=32, checkpoint_location=str(tmp_path),
                   backend="rocksdb", write_back_batches=3)
    assert job.write_back_batches == 3 and job.driver.options.write_back_batches == 3
    default = KeyedJob("j", "k", Total(), output_schema=OUT, max_parallelism=32, checkpoint_location=str(tmp_path))
    assert default.driver.options.write_back_batches is None   # the backend's default
