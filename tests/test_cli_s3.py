"""``keygroups inspect``, ``plan`` and ``verify`` on a checkpoint in a real S3 store (SeaweedFS on 127.0.0.1, see
s3_server.py): its endpoint and credentials come from ``--storage-option`` or from the environment variables s3fs
reads; bad options and a store that cannot be reached are errors that say so, never a traceback."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

DATA = pathlib.Path(__file__).parent / "data"
_AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE")


def keygroups(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command in its own process, with no AWS settings from this one's environment but those in ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in _AWS_ENV}
    # no credentials file of this machine's user may sign in its place
    clean |= {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
              "AWS_EC2_METADATA_DISABLED": "true"}   # nor an instance-metadata endpoint (a wait for a timeout)
    return subprocess.run([sys.executable, "-m", "keygroups", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=clean | (env or {}))


def options(s3_server) -> list[str]:
    """``--storage-option`` arguments for the session's server: endpoint and credentials, a JSON value among them."""
    return ["--storage-option", f"endpoint_url={s3_server.endpoint_url}", "--storage-option", f"key={s3_server.key}",
            "--storage-option", f"secret={s3_server.secret}",
            "--storage-option", 'client_kwargs:={"region_name": "us-east-1"}']


def environment(s3_server) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.key,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret, "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_checkpoint(s3_server):
    """A checkpoint written by keygroups (keyed state at parallelism 2, max parallelism 16), uploaded to a fresh
    prefix: its URL and the store paths of its state files."""
    url = s3_server.url()
    fs, root = s3_server.filesystem(), url.removeprefix("s3://")
    files = []
    for path in sorted((DATA / "keyed-checkpoint-v1" / "chk-1").iterdir()):
        fs.pipe_file(f"{root}/chk-1/{path.name}", path.read_bytes())
        if path.name != "_metadata":
            files.append(f"{root}/chk-1/{path.name}")
    yield url, files
    fs.rm(root, recursive=True)


def test_inspect_plan_and_verify_with_storage_options_or_the_environment(s3_server, s3_checkpoint):
    url, files = s3_checkpoint
    for how, args, env in [("options", options(s3_server), {}), ("environment", [], environment(s3_server))]:
        shown = keygroups("inspect", url, *args, env=env)
        assert shown.returncode == 0, (how, shown.stderr)
        assert "checkpoint 1 of job" in shown.stdout and "parallelism 2, max parallelism 16" in shown.stdout
        assert "complete checkpoints: [1]" in shown.stdout
        planned = keygroups("plan", url, "3", *args, env=env)
        assert planned.returncode == 0, (how, planned.stderr)
        assert "checkpoint 1: p=2 -> p'=3 (max parallelism 16)" in planned.stdout
        assert "new subtask 2 (key groups 11-15)" in planned.stdout
        checked = keygroups("verify", url, *args, env=env)
        assert checked.returncode == 0, (how, checked.stderr)
        assert checked.stdout.strip() == f"checkpoint 1: {len(files)} files read, 0 corrupt or missing"


def test_verify_finds_a_corrupt_object_in_the_store(s3_server, s3_checkpoint):
    url, files = s3_checkpoint
    fs = s3_server.filesystem()
    data = bytearray(fs.cat_file(files[0]))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(files[0], bytes(data))
    bad = keygroups("verify", url, *options(s3_server))
    assert bad.returncode == 1
    assert "CORRUPT" in bad.stderr and files[0].rsplit("/", 1)[1] in bad.stderr and "checksum" in bad.stderr
    assert bad.stdout.strip() == f"checkpoint 1: {len(files)} files read, 1 corrupt or missing"


def test_a_store_that_refuses_or_an_unknown_option_is_an_error_naming_it(s3_server, s3_checkpoint):
    url, _ = s3_checkpoint
    anonymous = keygroups("verify", url, "--storage-option", f"endpoint_url={s3_server.endpoint_url}")
    assert anonymous.returncode == 2
    assert f"keygroups verify: the storage client could not reach {url}: NoCredentialsError" in anonymous.stderr
    assert "AWS_ACCESS_KEY_ID" in anonymous.stderr
    wrong = keygroups("inspect", url, *options(s3_server), "--storage-option", "secret=wrong",
                      env={"AWS_ENDPOINT_URL": s3_server.endpoint_url})
    assert wrong.returncode == 2 and "argument --storage-option: secret is given twice" in wrong.stderr
    assert s3_server.secret not in wrong.stderr       # a secret is never echoed
    signed_wrong = keygroups("inspect", url, "--storage-option", f"key={s3_server.key}", "--storage-option",
                             "secret=wrong", env={"AWS_ENDPOINT_URL": s3_server.endpoint_url})
    assert signed_wrong.returncode == 2 and "keygroups inspect: " in signed_wrong.stderr
    unknown = keygroups("plan", url, "2", *options(s3_server), "--storage-option", "bogus_option=1")
    assert unknown.returncode == 2
    assert "keygroups plan: the storage options" in unknown.stderr and "'bogus_option'" in unknown.stderr
    for result in (anonymous, wrong, signed_wrong, unknown):
        assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("command, option, message", [
    (["inspect", "s3://b/x"], "endpoint_url", "'endpoint_url' is not KEY=VALUE or KEY:=JSON"),
    (["inspect", "s3://b/x"], "=x", "'=x' is not KEY=VALUE or KEY:=JSON"),
    (["inspect", "s3://b/x"], "anon:=yes", "the value of 'anon' (after :=) is not JSON"),
    (["plan", "s3://b/x", "2"], "endpoint_url", "'endpoint_url' is not KEY=VALUE or KEY:=JSON"),
    (["verify", "s3://b/x"], "anon:=yes", "the value of 'anon' (after :=) is not JSON"),
    (["demo"], "endpoint_url", "'endpoint_url' is not KEY=VALUE or KEY:=JSON"),
])
def test_a_malformed_storage_option_is_a_usage_error(command, option, message):
    result = keygroups(*command, "--storage-option", option)
    assert result.returncode == 2 and f"argument --storage-option: {message}" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
