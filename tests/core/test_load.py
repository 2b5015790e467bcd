"""fp_core.load's whole-file read (fp_core.loading.file_image) and fp_core.load_into, on real files."""

from __future__ import annotations

import gc
import hashlib
import io
import mmap
import os
import zipfile

import pytest
import torch
from conftest import assert_identical

import fp_core
from fp_core.errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from fp_core.loading import file_image


def _state():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g)
    return {
        "w": w,
        "row": w[7],  # a view: shares w's storage
        "t": w.t(),  # non-contiguous
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "ints": torch.arange(10_000, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
        "nested": [{"a": torch.ones(3)}, (torch.zeros(2, 2), 4)],
        "step": 12,
        "name": "run",
    }


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
@pytest.mark.parametrize("verify", [False, "auto"])
@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s])
@pytest.mark.parametrize("mmap", [False, True])
def test_load_equals_torch_load(disk_dir, writer, verify, map_location, mmap):
    obj = _state()
    path = os.path.join(disk_dir, "x.pt")
    (fp_core.save if writer == "fastpersist" else torch.save)(obj, path)
    want = torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    got = fp_core.load(path, weights_only=True, verify=verify, map_location=map_location, mmap=mmap)
    assert_identical(got, want)
    assert got["row"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()  # aliasing kept


def test_loaded_tensors_are_ordinary_writable_memory(disk_dir):
    """One buffer under every tensor: writable in place, alive while any tensor is, and
    never the file's pages (changing a tensor leaves the file as it was)."""
    path = os.path.join(disk_dir, "x.pt")
    obj = _state()
    fp_core.save(obj, path)
    got = fp_core.load(path, weights_only=True)
    ints = got["ints"]
    del got
    gc.collect()
    ints.add_(1)
    assert torch.equal(ints, obj["ints"] + 1)
    assert torch.equal(fp_core.load(path, weights_only=True, verify=True)["ints"], obj["ints"])


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_mmap_tensors_stay_on_the_file_copy_on_write(disk_dir):
    """mmap=True: the tensors are the file's private mapping (listed in /proc/self/maps
    while they live, gone once they are freed); writing one copies its pages and never
    reaches the file; a save that replaces the file by rename leaves them as they were."""
    path = os.path.join(disk_dir, "m.pt")
    obj = _state()
    fp_core.save(obj, path)
    before = _sha(path)
    fds = len(os.listdir("/proc/self/fd"))
    got = fp_core.load(path, weights_only=True, mmap=True, verify=True)
    assert path in _mapped_files()
    assert len(os.listdir("/proc/self/fd")) == fds  # the mapping holds no descriptor open
    assert_identical(got, obj)
    got["ints"].add_(1)
    assert torch.equal(got["ints"], obj["ints"] + 1) and _sha(path) == before
    fp_core.save({"w": torch.zeros(300, 200)}, path)  # replaced by rename under the mapping
    assert torch.equal(got["w"], obj["w"]) and torch.equal(got["half"], obj["half"])
    assert torch.equal(fp_core.load(path, weights_only=True, mmap=True)["w"], torch.zeros(300, 200))
    del got
    gc.collect()
    assert not any(p.startswith(path) for p in _mapped_files())


def test_mmap_verify_names_a_damaged_tensor(disk_dir):
    path = os.path.join(disk_dir, "m.pt")
    fp_core.save({"a": torch.zeros(1 << 20), "b": torch.ones(1 << 20)}, path)
    rec = next(r for r in fp_core.inspect(path) if r.get("tensor") == "b")
    with open(path, "r+b") as f:
        f.seek(rec["offset"] + rec["size"] // 2)
        f.write(b"\x7f")
    assert fp_core.load(path, weights_only=True, mmap=True)["a"].sum() == 0  # unchecked: loads
    with pytest.raises(CorruptCheckpointError, match="tensor b"):
        fp_core.load(path, weights_only=True, mmap=True, verify=True)


def test_mmap_of_a_file_truncated_after_it_was_opened_is_corrupt_not_a_crash(disk_dir):
    """The pages past a file's new end are an EFAULT of the populate call, never a SIGBUS."""
    from fp_core.loading.integrity import CheckpointFile

    path = os.path.join(disk_dir, "m.pt")
    fp_core.save({"a": torch.ones(12 << 20, dtype=torch.uint8)}, path)
    with CheckpointFile(path) as cf:  # after the mapping, before its reads
        buf = mmap.mmap(cf.fd, cf.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.truncate(path, cf.size // 3)
        with pytest.raises(CorruptCheckpointError, match="truncated while it was being loaded"):
            file_image.read_mapping_in(cf, buf, [])
        buf.close()
    with CheckpointFile(path) as cf:  # before the mapping
        os.truncate(path, cf.size // 2)
        with pytest.raises(CorruptCheckpointError, match="truncated while it was being loaded"):
            file_image.map_image(cf, [])


def test_mmap_falls_back_to_memory_of_its_own(disk_dir, monkeypatch):
    """Where the file cannot be mapped whole (torch's legacy format) or the kernel cannot
    populate a mapping for reading (before Linux 5.14: emulated by its EINVAL), mmap=True
    loads the same tensors into memory of their own."""
    import errno

    legacy = os.path.join(disk_dir, "legacy.pt")
    obj = _state()
    torch.save(obj, legacy, _use_new_zipfile_serialization=False)
    assert_identical(fp_core.load(legacy, weights_only=True, mmap=True), obj)
    path = os.path.join(disk_dir, "m.pt")
    fp_core.save(obj, path)
    real = file_image._native.populate

    def old_kernel(addr, n, *, write=True):
        if not write:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(addr, n)

    monkeypatch.setattr(file_image._native, "populate", old_kernel)
    got = fp_core.load(path, weights_only=True, mmap=True, verify=True)
    assert_identical(got, obj)
    assert path not in _mapped_files()


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("meta", ["meta", torch.device("meta")])
def test_map_location_meta_reads_no_bytes(disk_dir, mmap, meta, monkeypatch):
    path = os.path.join(disk_dir, "x.pt")
    fp_core.save(_state(), path)
    monkeypatch.setattr(file_image, "map_image", None)  # never mapped, never read whole
    monkeypatch.setattr(file_image, "read_image", None)
    got = fp_core.load(path, weights_only=True, map_location=meta, mmap=mmap)
    assert got["w"].device.type == "meta" and got["w"].shape == (300, 200)


def test_weights_only_refuses_code_like_torch_load(disk_dir):
    path = os.path.join(disk_dir, "x.pt")
    fp_core.save({"f": zipfile.ZipInfo("x")}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        fp_core.load(path, weights_only=True)
    assert isinstance(fp_core.load(path, weights_only=False)["f"], zipfile.ZipInfo)


def test_torch_fallback_reader_still_loads(disk_dir, monkeypatch):
    """Where torch lacks _load(overall_storage=...), torch.load reads through FastReader."""
    path = os.path.join(disk_dir, "x.pt")
    obj = _state()
    fp_core.save(obj, path)
    monkeypatch.setattr(file_image, "AVAILABLE", False)
    assert_identical(fp_core.load(path, weights_only=True, verify=True), obj)


def _zip_with(records: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            z.writestr(name, data)
    return out.getvalue()


def _records(path: str) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


@pytest.mark.parametrize("claimed", [400, 1 << 30])
@pytest.mark.parametrize("mmap", [False, True])
def test_pickle_asking_for_other_storage_bytes_is_corrupt(disk_dir, claimed, mmap):
    """A crafted file whose pickle claims more bytes for a storage than its record holds
    (the neighbours' bytes, or past the file): CorruptCheckpointError naming the pickle,
    never a tensor over other bytes."""
    small = os.path.join(disk_dir, "small.pt")
    torch.save({"a": torch.arange(100, dtype=torch.uint8), "b": torch.full((4000,), 7, dtype=torch.uint8)}, small)
    recs = _records(small)
    prefix = next(iter(recs)).split("/")[0]
    recs[f"{prefix}/data.pkl"] = _meta_pickle(claimed)
    bad = os.path.join(disk_dir, "bad.pt")
    with open(bad, "wb") as f:
        f.write(_zip_with(recs))
    with pytest.raises(CorruptCheckpointError, match="data.pkl"):
        fp_core.load(bad, weights_only=True, mmap=mmap)


def _meta_pickle(nbytes: int) -> bytes:
    """data.pkl of {"a": <uint8 tensor of nbytes>} whose storage is key "0"."""
    buf = io.BytesIO()
    with torch.serialization.skip_data():
        torch.save({"a": torch.empty(nbytes, dtype=torch.uint8)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:  # skip_data leaves the data records' CRCs unset
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


# ---------------------------------------------------------------------------- load_into


def _model_state(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("verify", [False, True])
def test_load_into_fills_the_existing_tensors_in_place(disk_dir, verify):
    m, opt = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save({"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 3, "w_t": m[0].weight.t()}, path)
    m2, opt2 = _model_state(1)
    target = {"model": m2.state_dict(), "optim": opt2.state_dict(), "epoch": 0,
              "w_t": torch.zeros(128, 64).t()}  # non-contiguous: filled through a host copy
    ptrs = [t.data_ptr() for t in m2.state_dict().values()]
    out = fp_core.load_into(target, path, verify=verify)
    assert [t.data_ptr() for t in m2.state_dict().values()] == ptrs
    assert_identical(m2.state_dict(), m.state_dict())
    assert_identical(opt2.state_dict(), opt.state_dict())
    assert out["epoch"] == 3 and out["model"]["0.weight"] is target["model"]["0.weight"]
    assert torch.equal(target["w_t"], m[0].weight.t())


def test_load_into_reads_stock_files_and_refuses_to_verify_them(disk_dir):
    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "stock.pt")
    torch.save(m.state_dict(), path)
    m2, _ = _model_state(1)
    fp_core.load_into(m2.state_dict(), path)
    assert_identical(m2.state_dict(), m.state_dict())
    with pytest.raises(NotAFastPersistCheckpoint):
        fp_core.load_into(m2.state_dict(), path, verify=True)


def test_load_into_refuses_a_target_of_another_shape_before_reading(disk_dir):
    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(m.state_dict(), path)
    wrong = {k: torch.zeros(v.shape) for k, v in m.state_dict().items()}
    wrong["2.bias"] = torch.zeros(9)
    with pytest.raises(ValueError, match=r"2\.bias.*\(8,\).*\(9,\)"):
        fp_core.load_into(wrong, path)
    assert all(not t.any() for t in wrong.values())  # nothing read
    missing = dict(wrong)
    del missing["2.bias"]
    with pytest.raises(ValueError, match="in the file only"):
        fp_core.load_into(missing, path)


def test_load_into_verify_names_a_damaged_tensor(disk_dir):
    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(m.state_dict(), path)
    rec = next(r for r in fp_core.inspect(path) if r.get("tensor") == "0.weight")
    with open(path, "r+b") as f:
        f.seek(rec["offset"] + 100)
        b = f.read(1)
        f.seek(rec["offset"] + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    m2, _ = _model_state(1)
    with pytest.raises(CorruptCheckpointError, match="0.weight"):
        fp_core.load_into(m2.state_dict(), path, verify=True)


def _local_header_name_byte(path: str, name_suffix: str) -> int:
    """The offset of the first byte of a record's name in its local header: covered by the
    structure CRC only (offsets come from the header's lengths, names from the directory)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name_suffix))
    return info.header_offset + 30


def test_load_into_verify_checks_the_zip_structure_beside_the_reads(disk_dir, monkeypatch):
    """The headers' other bytes are checked on a thread of their own while the tensors are
    read; a damaged one is the error raised, also when a tensor is damaged too, and the
    pickle is still checked before it is unpickled."""
    import threading

    from fp_core.loading import integrity, load_in_place

    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(m.state_dict(), path)
    ran_on: list[str] = []
    real = integrity.check_zip_structure

    def spy(cf, view, stop=None):
        ran_on.append(threading.current_thread().name)
        return real(cf, view, stop)

    monkeypatch.setattr(load_in_place, "check_zip_structure", spy)
    m2, _ = _model_state(1)
    fp_core.load_into(m2.state_dict(), path, verify=True)
    assert ran_on == ["fastpersist-verify-structure"]
    assert_identical(m2.state_dict(), m.state_dict())

    from conftest import flip_byte

    flip_byte(path, _local_header_name_byte(path, "/data/0"))
    with pytest.raises(CorruptCheckpointError, match="zip structure"):
        fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)
    rec = next(r for r in fp_core.inspect(path) if r.get("tensor") == "0.weight")
    flip_byte(path, rec["offset"] + 100)  # a tensor too: the structure's damage is still what is named
    with pytest.raises(CorruptCheckpointError, match="zip structure"):
        fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)
    checkers = [t for t in threading.enumerate() if t.name == "fastpersist-verify-structure"]
    for t in checkers:  # each ends just after the load that started it was told it is out
        t.join(5)
    assert not [t for t in checkers if t.is_alive()]

    fp_core.save(m.state_dict(), path)
    pkl = next(r for r in fp_core.inspect(path) if r["name"].endswith("data.pkl"))
    flip_byte(path, pkl["offset"] + 3)
    unpickled: list[int] = []
    for name in ("unpickle", "structure"):
        real_fn = getattr(load_in_place.plain_unpickle, name)
        monkeypatch.setattr(load_in_place.plain_unpickle, name, lambda *a, f=real_fn: unpickled.append(1) or f(*a))
    with pytest.raises(CorruptCheckpointError, match="data.pkl"):
        fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)
    assert not unpickled  # checked before it was unpickled
    flip_byte(path, _local_header_name_byte(path, "/data/0"))  # the structure too: named first, as before
    with pytest.raises(CorruptCheckpointError, match="zip structure"):
        fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)
    assert not unpickled


def test_load_into_verify_checks_the_local_headers_beside_the_reads(disk_dir, monkeypatch):
    """Verified, the storages' offsets come from the manifest (its tail's CRC held) and the
    local headers are checked against them on the structure's thread, not before the reads;
    a header pointing elsewhere is still the error raised."""
    import struct
    import threading

    from fp_core.loading import load_in_place

    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(m.state_dict(), path)
    ran_on: list[str] = []
    real = load_in_place.check_records_against_zip
    monkeypatch.setattr(load_in_place, "check_records_against_zip",
                        lambda cf, view: ran_on.append(threading.current_thread().name) or real(cf, view))
    fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)
    assert ran_on == ["fastpersist-verify-structure"]
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(path, "r+b") as f:  # the header's extra-field length: its data would start 4 bytes later
        f.seek(info.header_offset + 28)
        (n,) = struct.unpack("<H", f.read(2))
        f.seek(info.header_offset + 28)
        f.write(struct.pack("<H", n + 4))
    with pytest.raises(CorruptCheckpointError, match="data/0"):
        fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)
    with pytest.raises(CorruptCheckpointError):
        fp_core.verify(path)


def test_unchecked_load_into_takes_offsets_from_a_manifest_whose_checksum_holds(disk_dir, monkeypatch):
    """Without verify, the storages' offsets come from the manifest where its tail's CRC
    holds (no local header read before the tensors'), from the zip's headers where it does
    not: either way the bytes torch.load reads."""
    import struct

    from fp_core.loading import integrity

    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(m.state_dict(), path)
    header_reads: list[int] = []
    real = integrity.CheckpointFile.data_offsets
    monkeypatch.setattr(integrity.CheckpointFile, "data_offsets",
                        lambda self, infos: header_reads.append(len(infos)) or real(self, infos))
    m2, _ = _model_state(1)
    fp_core.load_into(m2.state_dict(), path)
    assert_identical(m2.state_dict(), m.state_dict())
    assert header_reads == []

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        comment_at = os.path.getsize(path) - len(z.comment)
    with open(path, "r+b") as f:  # the tail's checksum (the zip comment's last hex digit)
        f.seek(comment_at + len(z.comment) - 1)
        d = f.read(1)
        f.seek(comment_at + len(z.comment) - 1)
        f.write(b"0" if d != b"0" else b"1")
    m3, _ = _model_state(2)
    fp_core.load_into(m3.state_dict(), path)  # the headers' offsets, as torch.load
    assert_identical(m3.state_dict(), m.state_dict())
    assert header_reads

    fp_core.save(m.state_dict(), path)
    with open(path, "r+b") as f:  # a local header's extra-field length: torch.load reads 4 bytes late
        f.seek(info.header_offset + 28)
        (n,) = struct.unpack("<H", f.read(2))
        f.seek(info.header_offset + 28)
        f.write(struct.pack("<H", n + 4))
    m4, _ = _model_state(3)
    fp_core.load_into(m4.state_dict(), path)  # the manifest's offsets: the bytes that were written
    assert_identical(m4.state_dict(), m.state_dict())
    with pytest.raises(CorruptCheckpointError):
        fp_core.load_into(_model_state(1)[0].state_dict(), path, verify=True)


@pytest.mark.parametrize(("writer", "verify"), [("torch.save", False), ("fastpersist", False), ("fastpersist", True)])
def test_load_into_reads_expanded_and_empty_views_as_torch_load(disk_dir, writer, verify):
    """A view that spans fewer bytes than numel * element size (expanded: stride 0) or none
    (an empty view whose offset lies past its storage's end, which torch allows): load_into
    fills what torch.load reads, not a CorruptCheckpointError."""
    state = {"e": torch.randn(1, 4).expand(5, 4), "z": torch.randn(5).as_strided((0, 3), (3, 1), 9),
             "w": torch.randn(6, 3)}
    path = os.path.join(disk_dir, "views.pt")
    (torch.save if writer == "torch.save" else fp_core.save)(state, path)
    want = torch.load(path, weights_only=True)
    target = {"e": torch.empty(5, 4), "z": torch.empty(0, 3), "w": torch.empty(6, 3)}
    fp_core.load_into(target, path, verify=verify)
    for k in state:
        assert torch.equal(target[k], want[k]), k


def test_the_structure_check_stops_between_reads_when_asked(disk_dir):
    """An interrupt while load_into waits for its structure check asks the check to stop;
    it ends after the read in progress, not after the whole structure."""
    import threading

    from fp_core.loading import integrity

    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(m.state_dict(), path)
    stop = threading.Event()
    stop.set()
    with integrity.CheckpointFile(path) as cf:
        view = integrity.read_manifest(cf)
        with pytest.raises(InterruptedError, match="stopped"):
            integrity.check_zip_structure(cf, view, stop)
        integrity.check_zip_structure(cf, view, threading.Event())  # not set: checked whole


def test_beside_waits_for_its_thread_and_hands_over_its_error():
    import threading
    import time

    from fp_core.io.thread_wait import Beside

    assert Beside(lambda stop: None, "never-started").error() is None  # nothing to wait for
    seen: list[bool] = []

    def slow(stop):
        for _ in range(200):
            if stop.is_set():
                seen.append(True)
                raise InterruptedError("stopped")
            time.sleep(0.01)
        raise ValueError("the end")

    b = Beside(slow, "fastpersist-test-beside")
    b.start()
    with pytest.raises(ValueError, match="the end"):
        b.result()
    b = Beside(slow, "fastpersist-test-beside")
    b.start()
    t0 = time.perf_counter()
    assert isinstance(b.error(stop=True), InterruptedError) and seen
    assert time.perf_counter() - t0 < 1.0
    threads = [t for t in threading.enumerate() if t.name == "fastpersist-test-beside"]
    for t in threads:  # each ends just after it signalled it is out
        t.join(5)
    assert not [t for t in threads if t.is_alive()]


def test_files_written_in_the_async_layout_load_whole_and_in_place(disk_dir):
    """AsyncCheckpointer lays storages out congruent to their addresses (not where torch
    itself would put them): every loader must take each storage's offset from its zip
    header."""
    m, opt = _model_state(0)
    state = {"model": m.state_dict(), "optim": opt.state_dict()}
    path = os.path.join(disk_dir, "async.pt")
    with fp_core.AsyncCheckpointer(install_optimizer_hook=False) as ckpt:
        ckpt.save(state, path).result()
    assert_identical(fp_core.load(path, weights_only=True, verify=True), state)
    assert_identical(fp_core.load(path, weights_only=True), torch.load(path, weights_only=True))
    m2, opt2 = _model_state(1)
    fp_core.load_into({"model": m2.state_dict(), "optim": opt2.state_dict()}, path, verify=True)
    assert_identical(m2.state_dict(), m.state_dict())
    assert_identical(opt2.state_dict(), opt.state_dict())


def test_load_with_computed_storage_offsets_still_reads_async_layout_files(disk_dir):
    from torch.utils.serialization import config

    m, _ = _model_state(0)
    path = os.path.join(disk_dir, "async.pt")
    with fp_core.AsyncCheckpointer(install_optimizer_hook=False) as ckpt:
        ckpt.save(m.state_dict(), path).result()
    with config.patch({"load.calculate_storage_offsets": True}):
        assert_identical(fp_core.load(path, weights_only=True, verify=True), m.state_dict())


def test_fault_ahead_stop_interrupted_by_ctrl_c_waits_until_its_thread_is_off_the_buffer(monkeypatch, ctrl_c):
    """The load's fault-ahead thread must never outlive the buffer it faults in: a Ctrl-C
    that interrupts stop() is raised only once the thread is out (on Python 3.11 an
    interrupted join() took the running thread for stopped and returned at once)."""
    import threading
    import time
    import types

    from fp_core.loading import file_image

    spans: list[tuple[float, float]] = []

    def slow_populate(addr, n, **kw):
        began = time.perf_counter()
        time.sleep(0.3)
        spans.append((began, time.perf_counter()))
        return n

    monkeypatch.setattr(file_image, "_native", types.SimpleNamespace(populate=slow_populate))
    fa = file_image._FaultAhead(0, 1 << 20)  # the address is never touched: populate is the stand-in
    time.sleep(0.05)  # the thread is inside its populate
    timer = threading.Timer(0.05, ctrl_c)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fa.stop()
    finally:
        timer.cancel()
    raised = time.perf_counter()
    assert spans and spans[-1][1] <= raised, "stop() raised while its thread was still populating"


def test_a_verified_load_into_of_a_pickle_torch_must_read_checks_its_header_first(disk_dir):
    """A pickle that is not plain goes through torch's zip reader, which follows the local
    headers: a verified load checks them against the manifest before it unpickles."""
    import struct

    path = os.path.join(disk_dir, "c.pt")
    state = {"a": torch.arange(16, dtype=torch.float32), "s": {1, 2}}  # a set: torch's unpickler
    fp_core.save(state, path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    for delta in (1, 2, 4):
        fp_core.save(state, path)
        with open(path, "r+b") as f:  # the pickle's extra-field length: torch would read shifted bytes
            f.seek(info.header_offset + 28)
            (n,) = struct.unpack("<H", f.read(2))
            f.seek(info.header_offset + 28)
            f.write(struct.pack("<H", n + delta))
        with pytest.raises(CorruptCheckpointError, match="data.pkl"):
            fp_core.load_into({"a": torch.zeros(16), "s": None}, path, verify=True)


def _rewrite_manifest(path: str, mutate) -> None:
    """Change a file's manifest and make its checksums agree again (a crafted file)."""
    import json

    from fp_core import _native
    from fp_core.format.manifest import RECORD_SUFFIX
    from fp_core.format.plan import structure_crc
    from fp_core.loading.integrity import CheckpointFile

    with zipfile.ZipFile(path) as z:
        mi = next(i for i in z.infolist() if i.filename.endswith("/" + RECORD_SUFFIX))
    with CheckpointFile(path) as cf:
        moff = cf.data_offset(mi)
    with open(path, "r+b") as f:
        f.seek(moff)
        raw = f.read(mi.file_size)
        doc = json.loads(raw)
        mutate(doc)

        def pread(p: int, n: int) -> bytes:
            f.seek(p)
            return f.read(n)

        covered = [(r["offset"], r["offset"] + r["size"]) for r in doc["records"]]
        doc["structure_crc32c"] = f"{structure_crc(covered, mi.header_offset, pread):08x}"
        new = json.dumps(doc, separators=(",", ":")).encode()
        f.seek(moff)
        f.write(new + b" " * (len(raw) - len(new)))
        size = os.fstat(f.fileno()).st_size
        f.seek(mi.header_offset)
        body = f.read(size - 8 - mi.header_offset)
        f.seek(size - 8)
        f.write(b"%08x" % _native.crc32c(body))


def test_a_manifest_that_points_into_a_header_is_not_believed(disk_dir):
    """A crafted manifest whose checksums agree but whose storage starts inside its own
    local header: the unchecked load reads the zip's headers instead (torch.load's bytes),
    the verified one refuses the file."""
    path = os.path.join(disk_dir, "c.pt")
    state = {"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(16, dtype=torch.float32) + 100}
    fp_core.save(state, path)
    with zipfile.ZipFile(path) as z:
        info = {i.filename: i for i in z.infolist()}

    def into_header(doc: dict) -> None:
        for r in doc["records"]:
            if r["name"].endswith("data/1"):
                r["offset"] = info[r["name"]].header_offset + 1

    _rewrite_manifest(path, into_header)
    target = {"a": torch.zeros(16), "b": torch.zeros(16)}
    fp_core.load_into(target, path)
    assert_identical(target, torch.load(path))
    with pytest.raises(CorruptCheckpointError, match="data/1"):
        fp_core.load_into({"a": torch.zeros(16), "b": torch.zeros(16)}, path, verify=True)


def test_only_the_pickle_and_the_byte_order_are_kept_in_memory(disk_dir):
    """Records other than storages are checked; only the two a load reads are kept (a
    crafted manifest calling every storage a record must not bring the file into memory)."""
    from fp_core.loading.integrity import CheckpointFile, read_manifest, read_small_records

    path = os.path.join(disk_dir, "c.pt")
    fp_core.save({"a": torch.arange(16.0)}, path)
    with CheckpointFile(path) as cf:
        kept = read_small_records(cf, read_manifest(cf))
    assert sorted(n.rpartition("/")[2] for n in kept) == ["byteorder", "data.pkl"]


def test_a_zip_whose_first_entry_is_in_no_folder_is_refused_as_torch_refuses_it(disk_dir):
    """torch's reader takes the archive's folder from the zip's first entry and refuses a
    file whose first entry is in none; load_into, with or without verify, answers the same
    even where the manifest's checksums agree."""
    import json

    from fp_core import _native
    from fp_core.format.manifest import RECORD_SUFFIX, TAIL_COMMENT_PREFIX
    from fp_core.loading.integrity import CheckpointFile

    src, path = os.path.join(disk_dir, "src.pt"), os.path.join(disk_dir, "c.pt")
    fp_core.save({"a": torch.arange(8.0)}, src)
    with CheckpointFile(src) as cf:
        raw = {i.filename: cf.pread(cf.data_offset(i), i.file_size) for i in cf.zip_directory()[0]}
    mname = next(n for n in raw if n.endswith(RECORD_SUFFIX))
    by_name = {r["name"]: r for r in json.loads(raw[mname])["records"]}
    items = [("archive", b"")] + [(n, b) for n, b in raw.items() if n != mname]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, b in items:
            z.writestr(n, b)
        z.writestr(mname, raw[mname] + b" " * 400)  # room for the longer manifest below
        z.comment = TAIL_COMMENT_PREFIX + b"00000000"
    with CheckpointFile(path) as cf:
        offs = {i.filename: cf.data_offset(i) for i in cf.zip_directory()[0]}

    def describe_new_entries(doc: dict) -> None:
        doc["records"] = [dict(by_name.get(n, {"kind": "record"}), name=n, offset=offs[n], size=len(b),
                               crc32c=f"{_native.crc32c(b):08x}") for n, b in items]
        doc["file_size"] = os.path.getsize(path)

    _rewrite_manifest(path, describe_new_entries)
    fp_core.verify(path)  # the crafted file's checksums agree
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        torch.load(path)
    for verify in (False, True):
        target = {"a": torch.zeros(8)}
        with pytest.raises(RuntimeError, match="not in a subdirectory"):
            fp_core.load_into(target, path, verify=verify)
        assert not target["a"].any()


def test_load_into_an_empty_zip_keeps_torchs_zip_reader_error(disk_dir):
    """No entry to take an archive folder from: torch's zip reader's error, not an IndexError."""
    path = os.path.join(disk_dir, "empty.pt")
    zipfile.ZipFile(path, "w").close()
    with pytest.raises(RuntimeError, match="does not contain any files"):
        fp_core.load_into({"a": torch.zeros(2)}, path)
