"""Remote storage tier (fp_core.remote, DESIGN D8) against a real S3 server on loopback
(moto's server mode, tests/helpers/s3_server.py) and fsspec's memory:// filesystem."""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid

import pytest
import torch
from conftest import HELPERS, assert_identical

import fp_core
from fp_core import remote
from fp_core.saving import commit

sys.path.insert(0, HELPERS)

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

MiB = 1 << 20


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def mem():
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/fp-" + uuid.uuid4().hex[:12]
    yield fs, f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def state(seed: int = 0, n: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, n, generator=g), "b": torch.arange(1000, dtype=torch.int64) + seed,
            "half": torch.randn(3, 7, generator=g).half(), "step": seed, "name": "model"}


def staged_files(d: str) -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(d, "pending")):
        out += [os.path.join(root, f) for f in files]
    return out


def cached_files(d: str) -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(d, "cache")):
        out += [os.path.join(root, f) for f in files]
    return out


def s3fs_of(opts: dict):
    from fsspec.core import url_to_fs

    return url_to_fs("s3://x", **opts)[0]


# ---------------------------------------------------------------- paths


def test_split_local_and_remote(tmp_path):
    assert remote.split("/a/b.pt") == (False, "/a/b.pt")
    assert remote.split("rel/b.pt") == (False, "rel/b.pt")
    assert remote.split("file:///a/b.pt") == (False, "/a/b.pt")
    assert remote.split(tmp_path / "x.pt") == (False, str(tmp_path / "x.pt"))
    for url in ("s3://b/k.pt", "memory://x/y", "gs://b/k", "az://c/k", "hdfs://nn/p", "simplecache::s3://b/k"):
        assert remote.split(url) == (True, url)


def test_file_url_keeps_the_native_path(tmp_path, staging):
    p = tmp_path / "a.pt"
    st = fp_core.save(state(), f"file://{p}")
    assert st.path == str(p) and "upload_seconds" not in st.extra
    assert_identical(fp_core.load(f"file://{p}"), state())
    assert not os.path.exists(staging) or not staged_files(staging)


# ---------------------------------------------------------------- round trips


def test_memory_round_trip(mem, staging):
    fs, root = mem
    url = f"{root}/ckpt/step1.pt"
    st = fp_core.save(state(1), url)
    assert st.path == url and st.extra["upload_seconds"] >= 0 and st.bytes == fs.info(url)["size"]
    assert_identical(fp_core.load(url), state(1))
    assert_identical(fp_core.load(url, verify=True), state(1))
    assert remote.verify(url)  # every record checked on a staged copy
    assert fs.ls(f"{root}/ckpt", detail=False) == [f"{root[len('memory://'):]}/ckpt/step1.pt"]  # no temp left
    assert staged_files(staging) == [] and cached_files(staging) == []
    # overwrite in place: the old copy is replaced whole
    fp_core.save(state(2), url)
    assert_identical(fp_core.load(url), state(2))


def test_s3_round_trip(s3, staging):
    srv, bucket, opts = s3
    url = f"{bucket}/run/epoch=0.ckpt"
    st = fp_core.save(state(3), url, storage_options=opts)
    assert st.path == url
    assert_identical(fp_core.load(url, storage_options=opts, verify=True), state(3))
    assert_identical(fp_core.load(url, map_location="cpu", weights_only=False, storage_options=opts), state(3))
    assert remote.exists(url, storage_options=opts)
    head = srv.boto3_client().head_object(Bucket=bucket[5:], Key="run/epoch=0.ckpt")
    assert head["ContentLength"] == st.bytes
    # torch.load of the downloaded object: the stored bytes are a standard torch.save file
    import io

    body = srv.boto3_client().get_object(Bucket=bucket[5:], Key="run/epoch=0.ckpt")["Body"].read()
    assert_identical(torch.load(io.BytesIO(body), weights_only=False), state(3))
    assert staged_files(staging) == [] and cached_files(staging) == []
    remote.remove(url, storage_options=opts)
    assert not remote.exists(url, storage_options=opts)
    remote.remove(url, storage_options=opts)  # missing is fine
    with pytest.raises(FileNotFoundError):
        remote.remove(url, storage_options=opts, missing_ok=False)
    with pytest.raises(FileNotFoundError):
        fp_core.load(url, storage_options=opts)


def test_safetensors_to_s3(s3, staging):
    _, bucket, opts = s3
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(64, 64), "b": torch.ones(10, dtype=torch.int32)}
    url = f"{bucket}/m/model.safetensors"
    fp_core.save(tensors, url, format="safetensors", metadata={"format": "pt"}, storage_options=opts)
    with remote.fetch(url, storage_options=opts) as local:
        got = load_file(local)
    assert_identical(got, tensors)


def test_serialization_error_leaves_nothing(mem, staging):
    fs, root = mem
    url = f"{root}/bad.pt"
    with pytest.raises(fp_core.CheckpointSerializationError):
        fp_core.save({"f": lambda: 0, "w": torch.zeros(4)}, url)
    assert not fs.exists(url) and staged_files(staging) == []


def test_collective_remote_is_refused(mem, staging):
    with pytest.raises(ValueError, match="remote"):
        fp_core.save(state(), f"{mem[1]}/x.pt", sharded=True)


# ---------------------------------------------------------------- async


def test_async_to_s3_on_commit_after_upload(s3, staging):
    srv, bucket, opts = s3
    seen = []
    fs = s3fs_of(opts)

    def on_commit(path, stats):
        info = fs.info(path)  # the remote copy is complete when on_commit runs
        seen.append((path, info["size"], stats.bytes, staged_files(staging)))

    urls = [f"{bucket}/ckpt/step{i}.pt" for i in range(3)]
    with fp_core.AsyncCheckpointer(max_in_flight=1, install_optimizer_hook=False) as ck:
        handles = [ck.save(state(i), u, on_commit=on_commit, storage_options=opts) for i, u in enumerate(urls)]
        assert handles[-1].path == urls[-1]
        ck.wait_for(urls[-1])
        assert not ck.pending(urls[-1])
        stats = [h.result() for h in handles]
    assert [s[0] for s in seen] == urls
    assert all(size == nbytes and left == [] for _, size, nbytes, left in seen)
    assert all(s.extra["upload_seconds"] >= 0 and s.path == u for s, u in zip(stats, urls))
    for i, u in enumerate(urls):
        assert_identical(fp_core.load(u, storage_options=opts), state(i))
    assert staged_files(staging) == []


def test_async_returns_before_upload(mem, staging, monkeypatch):
    """save() returns while the upload is still held back; result() covers it."""
    fs, root = mem
    gate = threading.Event()
    real = remote.upload_file

    def slow_upload(*a, **kw):
        assert gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(remote, "upload_file", slow_upload)
    url = f"{root}/a.pt"
    ck = fp_core.AsyncCheckpointer(install_optimizer_hook=False)
    try:
        h = ck.save(state(5), url)
        assert not h.done() and ck.pending(url) and not fs.exists(url)
        gate.set()
        assert h.result(timeout=20).path == url
        assert fs.exists(url)
    finally:
        gate.set()
        ck.close()
    assert_identical(fp_core.load(url), state(5))


def test_upload_failure_is_surfaced_and_leaves_nothing(s3, staging, fast_fail):
    """The store goes down mid-run: the failed save raises at the next call, no complete-
    looking object appears for it, the earlier checkpoint stays, staging is clean."""
    srv, bucket, opts = s3
    good, bad = f"{bucket}/c/step1.pt", f"{bucket}/c/step2.pt"
    commits = []
    ck = fp_core.AsyncCheckpointer(install_optimizer_hook=False)
    try:
        ck.save(state(1), good, storage_options=opts, on_commit=lambda p, s: commits.append(p)).result()
        srv.stop()
        h = ck.save(state(2), bad, storage_options=opts, on_commit=lambda p, s: commits.append(p))
        with pytest.raises(fp_core.AsyncCheckpointError) as ei:
            ck.wait()
        assert isinstance(ei.value.__cause__, Exception)
        assert h.exception() is not None
        assert staged_files(staging) == []
    finally:
        ck.close()
    assert commits == [good]
    srv.start()
    keys = [o["Key"] for o in srv.boto3_client().list_objects_v2(Bucket=bucket[5:]).get("Contents", [])]
    assert keys == ["c/step1.pt"]
    assert_identical(fp_core.load(good, storage_options=opts), state(1))


def test_sync_save_failure_raises_and_cleans(s3, staging, fast_fail):
    srv, bucket, opts = s3
    srv.stop()
    with pytest.raises(Exception):  # noqa: B017 - whatever the store's client raises (OSError / ClientError)
        fp_core.save(state(), f"{bucket}/x.pt", storage_options=opts, keep_local=True)
    assert staged_files(staging) == [] and cached_files(staging) == []


def test_multipart_upload_cut_mid_way_publishes_nothing(s3, tmp_path, staging, fast_fail):
    """A multipart upload that loses the server after its first part never becomes an object."""
    from fsspec.callbacks import Callback

    srv, bucket, opts = s3
    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(11 * MiB))

    class StopAfterFirstPart(Callback):
        def call(self, *a, **kw):
            if self.value and srv.running:
                srv.stop()

    url = f"{bucket}/big.bin"
    with pytest.raises(Exception):  # noqa: B017
        remote.upload_file(local, url, storage_options=opts, callback=StopAfterFirstPart(),
                           chunksize=5 * MiB, max_concurrency=1)
    srv.start()
    assert not remote.exists(url, storage_options=opts)
    # and with the server up the same upload goes through as one complete object
    info = remote.upload_file(local, url, storage_options=opts, chunksize=5 * MiB, max_concurrency=2)
    assert info["size"] == 11 * MiB
    body = srv.boto3_client().get_object(Bucket=bucket[5:], Key="big.bin")["Body"].read()
    assert body == local.read_bytes()


def test_rename_filesystem_uses_temp_then_move(mem, tmp_path, staging, monkeypatch):
    fs, root = mem
    local = tmp_path / "f.bin"
    local.write_bytes(b"x" * 5000)
    url = f"{root}/d/f.bin"
    remote.upload_file(local, url)
    assert fs.cat(url) == b"x" * 5000
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/d", detail=False)] == ["f.bin"]

    def broken_mv(*a, **kw):
        raise OSError("mv failed")

    local.write_bytes(b"y" * 6000)
    monkeypatch.setattr(type(fs), "mv", broken_mv)
    with pytest.raises(OSError, match="mv failed"):
        remote.upload_file(local, url)
    assert fs.cat(url) == b"x" * 5000  # the old copy is untouched, the temp is gone
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/d", detail=False)] == ["f.bin"]


# ---------------------------------------------------------------- local cache


def test_a_replaced_cached_copy_is_freed_in_the_background(staging):
    """keep_local: saving the same URL again replaces its cached copy; the old copy's
    blocks are freed off the caller's path, as a replaced local checkpoint's are."""
    from fp_core.io import deferred_free

    url = f"memory://fp-cache-{uuid.uuid4().hex[:8]}/last.pt"
    big = {"w": torch.full((6 << 20,), 1.0)}  # 24 MiB: above deferred_free.MIN_BYTES
    first = fp_core.save(big, url, keep_local=True).extra["cached"]
    with deferred_free.paused():
        second = fp_core.save({"w": torch.full((6 << 20,), 2.0)}, url, keep_local=True).extra["cached"]
        assert second == first and os.path.isfile(second)  # the same place, the new copy
        if deferred_free.fs_type(os.stat(staging).st_dev) not in deferred_free.PINNED_FS:
            pytest.skip("the staging directory is on a filesystem deferred_free does not pin")
        held = [fd for fd in os.listdir("/proc/self/fd")
                if os.path.realpath(f"/proc/self/fd/{fd}").startswith(first) and
                os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")]
        assert len(held) == 1, "the old cached copy was not pinned for a background free"
    deferred_free.wait()
    assert_identical(fp_core.load(url, keep_local=True), {"w": torch.full((6 << 20,), 2.0)})



def test_keep_local_cache(s3, staging, monkeypatch, caplog):
    srv, bucket, opts = s3
    url = f"{bucket}/k/last.ckpt"
    st = fp_core.save(state(7), url, storage_options=opts, keep_local=True)
    cached = st.extra["cached"]
    assert os.path.isfile(cached) and staged_files(staging) == []

    import fsspec.spec

    def no_download(*a, **kw):
        raise AssertionError("downloaded although the cache is valid")

    s3fs = pytest.importorskip("s3fs")
    with monkeypatch.context() as m:
        m.setattr(s3fs.S3FileSystem, "get_file", no_download)
        m.setattr(fsspec.spec.AbstractFileSystem, "get_file", no_download)
        with caplog.at_level(logging.INFO, logger="fastpersist"):
            assert_identical(fp_core.load(url, storage_options=opts, verify=True), state(7))
        assert "using the local copy" in caplog.text

    # someone else replaces the object: the fingerprint no longer matches, it is downloaded
    fs = s3fs_of(opts)
    body = fs.cat_file(url)
    other = f"{bucket}/k/other.ckpt"
    fp_core.save(state(8), other, storage_options=opts)
    srv.boto3_client().copy_object(Bucket=bucket[5:], Key="k/last.ckpt",
                                   CopySource={"Bucket": bucket[5:], "Key": "k/other.ckpt"})
    assert fs.cat_file(url) != body
    assert_identical(fp_core.load(url, storage_options=opts), state(8))

    # a save without keep_local drops the stale cache entry; remove drops it too
    fp_core.save(state(9), url, storage_options=opts, keep_local=True)
    assert cached_files(staging)
    remote.remove(url, storage_options=opts)
    assert cached_files(staging) == []

    # load(keep_local=True) fills the cache from a download
    fp_core.save(state(10), url, storage_options=opts)
    assert cached_files(staging) == []
    assert_identical(fp_core.load(url, storage_options=opts, keep_local=True), state(10))
    assert len([f for f in cached_files(staging) if f.endswith("last.ckpt")]) == 1


def test_staging_budget_evicts_oldest(mem, tmp_path):
    fs, root = mem
    d = str(tmp_path / "stage")
    remote.configure(staging_dir=d)
    one = fp_core.save(state(0), f"{root}/probe.pt").bytes
    remote.configure(staging_dir=d, staging_budget_bytes=int(2.5 * one))
    try:
        for i in range(4):
            fp_core.save(state(i), f"{root}/c{i}.pt", keep_local=True)
        names = sorted(os.path.basename(f) for f in cached_files(d) if f.endswith(".pt"))
        assert names == ["c2.pt", "c3.pt"]
        for i in range(4):
            assert_identical(fp_core.load(f"{root}/c{i}.pt"), state(i))
    finally:
        remote.configure(None, None)


def test_staging_dir_from_env(tmp_path, monkeypatch, mem):
    d = str(tmp_path / "envstage")
    remote.configure(None, None)
    monkeypatch.setenv(remote.STAGING_ENV, d)
    monkeypatch.setenv(remote.BUDGET_ENV, "64M")
    assert remote.staging_dir() == d and remote.staging_budget() == 64 * MiB
    fp_core.save(state(), f"{mem[1]}/e.pt", keep_local=True)
    assert any(f.endswith("e.pt") for f in cached_files(d))


def test_stale_staging_slots_are_cleaned(tmp_path):
    d = str(tmp_path / "st")
    host = commit.writer_tag().rsplit("-", 1)[0]
    dead = os.path.join(d, "pending", f"{host}-999999999-0123456789ab")
    os.makedirs(dead)
    open(os.path.join(dead, "x.pt"), "w").close()
    assert remote.clean_staging(d) == [dead]


# ---------------------------------------------------------------- directories


def _make_dir(tmp_path, name="checkpoint-10", seed=0) -> str:
    d = tmp_path / name
    (d / "sub").mkdir(parents=True)
    fp_core.save(state(seed), d / "optimizer.pt")
    fp_core.save({"w": torch.ones(8)}, d / "model.safetensors", format="safetensors")
    (d / "trainer_state.json").write_text(f'{{"global_step": {seed}}}')
    (d / "sub" / "rng.pth").write_bytes(b"r" * 100)
    return str(d)


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_upload_dir_list_download_remove(store, request, tmp_path, staging):
    if store == "s3":
        _, parent, opts = request.getfixturevalue("s3")
        parent += "/run"
    else:
        parent, opts = request.getfixturevalue("mem")[1] + "/run", None
    for step in (10, 20):
        remote.upload_dir(_make_dir(tmp_path, f"checkpoint-{step}", step), f"{parent}/checkpoint-{step}",
                          storage_options=opts, batch_size=2)
    # an incomplete directory (upload in progress / crashed): files but no marker
    fs, rp = remote.filesystem(f"{parent}/checkpoint-30", opts)
    fs.pipe_file(rp + "/optimizer.pt", b"partial")
    assert remote.list_complete(parent, "checkpoint-", storage_options=opts) == [
        f"{parent}/checkpoint-10", f"{parent}/checkpoint-20"]
    assert remote.is_complete(f"{parent}/checkpoint-20", storage_options=opts)
    assert not remote.is_complete(f"{parent}/checkpoint-30", storage_options=opts)
    assert not remote.exists(f"{parent}/checkpoint-30", storage_options=opts)
    with pytest.raises(FileNotFoundError):
        remote.download_dir(f"{parent}/checkpoint-30", tmp_path / "dl", storage_options=opts)

    local = remote.download_dir(f"{parent}/checkpoint-20", storage_options=opts)
    assert_identical(fp_core.load(os.path.join(local, "optimizer.pt")), state(20))
    assert open(os.path.join(local, "sub", "rng.pth"), "rb").read() == b"r" * 100
    assert remote.download_dir(f"{parent}/checkpoint-20", storage_options=opts) == local  # cached
    out = remote.download_dir(f"{parent}/checkpoint-10", tmp_path / "resume", storage_options=opts)
    assert sorted(os.listdir(out)) == sorted([".fastpersist-complete", "optimizer.pt", "model.safetensors",
                                              "trainer_state.json", "sub"])
    # a checkpoint file inside a directory loads directly too
    assert_identical(fp_core.load(f"{parent}/checkpoint-10/optimizer.pt", storage_options=opts), state(10))

    # re-upload replaces; rotation removes the oldest
    remote.upload_dir(_make_dir(tmp_path / "again", "checkpoint-20", 21), f"{parent}/checkpoint-20",
                      storage_options=opts)
    assert_identical(fp_core.load(f"{parent}/checkpoint-20/optimizer.pt", storage_options=opts), state(21))
    with pytest.raises(IsADirectoryError):
        remote.remove(f"{parent}/checkpoint-10", storage_options=opts)
    remote.remove(f"{parent}/checkpoint-10", recursive=True, storage_options=opts)
    remote.remove(f"{parent}/checkpoint-30", recursive=True, storage_options=opts)
    assert remote.list_complete(parent, "checkpoint-", storage_options=opts) == [f"{parent}/checkpoint-20"]
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(remote.filesystem(parent, opts)[1], detail=False)]
    assert names == ["checkpoint-20"]  # no temporaries


def test_upload_dir_failure_is_not_complete(s3, tmp_path, staging, fast_fail):
    srv, bucket, opts = s3
    src = _make_dir(tmp_path)
    srv.stop()
    with pytest.raises(Exception):  # noqa: B017
        remote.upload_dir(src, f"{bucket}/checkpoint-10", storage_options=opts)
    srv.start()
    assert not remote.is_complete(f"{bucket}/checkpoint-10", storage_options=opts)
    assert remote.list_complete(bucket, "checkpoint-", storage_options=opts) == []


def test_storage_options_from_fsspec_config(s3, staging, monkeypatch):
    """Without storage_options, fsspec's own config (fsspec.config.conf / FSSPEC_S3 env)
    applies: the way to reach a store through frameworks that make their own fsspec calls."""
    import fsspec.config

    srv, bucket, opts = s3
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(opts))
    url = f"{bucket}/conf/a.pt"
    with fp_core.AsyncCheckpointer(install_optimizer_hook=False) as ck:
        ck.save(state(4), url)
    assert_identical(fp_core.load(url), state(4))
    remote.remove(url)
    assert not remote.exists(url)
