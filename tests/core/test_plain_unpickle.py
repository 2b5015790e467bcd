"""The plain-pickle fast path of the loaders (fp_core.format.plain_unpickle): what it reads equals
what torch.load reads, and anything it does not know goes to torch's own unpickler."""

from __future__ import annotations

import collections
import os
import pickle

import numpy as np
import pytest
import torch

import fp_core
from fp_core.format import plain_unpickle


def _zip_reader(path):
    return torch.serialization._open_zipfile_reader(open(path, "rb"))  # noqa: SIM115 - closed with the reader


def _cpu_storage_at(zf):
    def storage_at(key, nbytes, location):
        if location != "cpu":
            raise plain_unpickle.NotPlain(location)
        return zf.get_storage_from_record(f"data/{key}", nbytes, torch.UntypedStorage)._typed_storage()._untyped_storage
    return storage_at


def _plain_state():
    g = torch.Generator().manual_seed(3)
    model = collections.OrderedDict()
    model["w"] = torch.randn(64, 32, generator=g)
    model["b"] = torch.zeros(32, dtype=torch.bfloat16)
    model["tied"] = model["w"]  # one tensor under two keys
    model._metadata = collections.OrderedDict({"": {"version": 1}})  # what nn.Module.state_dict() carries
    base = torch.arange(100, dtype=torch.float64)
    return {
        "model": model,
        "views": [base[10:20], base[::3], base.view(10, 10).t()],  # offsets, strides, one shared storage
        "dtypes": {str(dt): torch.ones(5, dtype=dt) for dt in (torch.float16, torch.int64, torch.int32, torch.int16,
                                                             torch.int8, torch.uint8, torch.bool, torch.complex64,
                                                             torch.complex128)},
        "grad": torch.ones(3, requires_grad=True),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "meta": {"step": 7, "lr": 1e-3, "name": "run", "none": None, "flags": (True, False), "blob": b"\x00\x01"},
    }


def _same(a, b, seen=None):
    """Equal structure, types, tensors (values, dtype, shape, strides, offsets, grad) and
    storage sharing."""
    seen = {} if seen is None else seen
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
        assert torch.equal(a.detach(), b.detach())
        # storages shared in one are shared in the other
        key = a.untyped_storage().data_ptr()
        assert seen.setdefault(key, b.untyped_storage().data_ptr()) == b.untyped_storage().data_ptr()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for k in a:
            _same(a[k], b[k], seen)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, seen)
    else:
        assert a == b


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_plain_state_reads_as_torch_load_reads_it(tmp_path, writer):
    state = _plain_state()
    path = str(tmp_path / "s.pt")
    torch.save(state, path) if writer == "torch" else fp_core.save(state, path)
    expected = torch.load(path, weights_only=True)
    with _zip_reader(path) as zf:
        fast = plain_unpickle.unpickle(zf, _cpu_storage_at(zf))
    assert fast is not NotImplemented  # the fast path read it
    _same(expected, fast)
    assert fast["model"]["tied"] is fast["model"]["w"]
    _same(expected, fp_core.load(path, weights_only=True))
    _same(expected, fp_core.load(path, weights_only=True, verify=writer == "fastpersist"))


class _Custom:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, _Custom) and other.v == self.v


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("extra", [
    torch.nn.Parameter(torch.ones(2)),
    torch.device("cpu"),
    torch.float32,
    np.arange(3),
    _Custom(3),
])
def test_anything_else_goes_to_torch(tmp_path, extra):
    """A pickle naming any other global is torch's to read: the result is torch.load's."""
    path = str(tmp_path / "o.pt")
    torch.save({"x": torch.ones(4), "extra": extra}, path)
    with _zip_reader(path) as zf:
        assert plain_unpickle.unpickle(zf, _cpu_storage_at(zf)) is NotImplemented
    got, expected = fp_core.load(path, weights_only=False), torch.load(path, weights_only=False)
    assert torch.equal(got["x"], expected["x"])
    assert type(got["extra"]) is type(expected["extra"])


def test_a_hostile_pickle_runs_nothing(tmp_path):
    """A global outside the list is never resolved: nothing runs, and with weights_only the
    load is torch's refusal."""
    target = tmp_path / "pwned"
    path = str(tmp_path / "evil.pt")
    torch.save({"x": torch.ones(2), "e": _Evil(str(target))}, path)
    with _zip_reader(path) as zf:
        assert plain_unpickle.unpickle(zf, _cpu_storage_at(zf)) is NotImplemented
    assert not target.exists()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fp_core.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError):
        fp_core.load_into({"x": torch.zeros(2), "e": None}, path)
    assert not target.exists()


def test_tensor_with_hooks_or_metadata_is_not_plain(tmp_path):
    path = str(tmp_path / "n.pt")
    t = torch.ones(3)
    torch.save({"neg": t.neg().conj() if t.is_complex() else torch.ones(2, dtype=torch.complex64).conj()}, path)
    with _zip_reader(path) as zf:
        assert plain_unpickle.unpickle(zf, _cpu_storage_at(zf)) is NotImplemented  # conj bit: metadata
    got = fp_core.load(path, weights_only=True)["neg"]
    assert got.is_conj() and torch.equal(got, torch.load(path, weights_only=True)["neg"])


def test_storages_on_another_device_go_to_torch(tmp_path):
    """storage_at refuses what it cannot give (here: a location other than the CPU)."""
    path = str(tmp_path / "d.pt")
    torch.save({"x": torch.ones(2)}, path)

    def refuse(key, nbytes, location):
        raise plain_unpickle.NotPlain(location)

    with _zip_reader(path) as zf:
        assert plain_unpickle.unpickle(zf, refuse) is NotImplemented


def test_big_endian_files_go_to_torch(tmp_path):
    class Reader:
        def has_record(self, name):
            return name == "byteorder"

        def get_record(self, name):
            return b"big"

    assert plain_unpickle.unpickle(Reader(), lambda *a: None) is NotImplemented


def test_load_into_reads_a_plain_file_without_torch_unpickler(tmp_path, monkeypatch):
    """load_into's structure comes from the fast path (torch's unpickler is not called) and
    fills the targets byte-exact."""
    state = _plain_state()
    path = str(tmp_path / "s.pt")
    fp_core.save(state, path)
    from fp_core.loading import file_image

    def no_torch(*a, **k):
        raise AssertionError("torch's unpickler was used")

    monkeypatch.setattr(file_image, "unpickle", no_torch)
    target = {"model": collections.OrderedDict((k, torch.zeros_like(v)) for k, v in state["model"].items()),
              "views": [torch.zeros_like(v) for v in state["views"]],
              "dtypes": {k: torch.zeros_like(v) for k, v in state["dtypes"].items()},
              "grad": torch.zeros(3), "empty": torch.empty(0, 4), "scalar": torch.tensor(0.0),
              "meta": dict(state["meta"])}
    out = fp_core.load_into(target, path, verify=True)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v)
    for got, want in zip(target["views"], state["views"]):
        assert torch.equal(got, want)
    for k, v in state["dtypes"].items():
        assert torch.equal(target["dtypes"][k], v)
    assert out["meta"] == state["meta"] and float(target["scalar"]) == 2.5


def test_load_into_a_big_endian_file_gets_torch_loads_values(tmp_path):
    """A file written on a big-endian machine (its byteorder record says so, its storages
    are byte-swapped): load_into fills the values torch.load reads, not the raw bytes."""
    import zipfile

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "i": torch.arange(5, dtype=torch.int64),
             "h": torch.arange(3, dtype=torch.float16)}
    little = str(tmp_path / "little.pt")
    torch.save(state, little)
    dtypes = {}  # record key -> element size, from the order torch.save writes storages
    for key, t in zip(range(len(state)), state.values()):
        dtypes[str(key)] = t.element_size()
    big = str(tmp_path / "big.pt")
    with zipfile.ZipFile(little) as zin, zipfile.ZipFile(big, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            parts = info.filename.split("/")
            if parts[-1] == "byteorder":
                data = b"big"
            elif len(parts) == 3 and parts[1] == "data":
                data = np.frombuffer(data, dtype=f"<u{dtypes[parts[2]]}").astype(f">u{dtypes[parts[2]]}").tobytes()
            zout.writestr(info.filename, data)
    expected = torch.load(big, weights_only=True)
    for k, v in state.items():
        assert torch.equal(expected[k], v)  # torch swapped them back
    with _zip_reader(big) as zf:
        assert plain_unpickle.unpickle(zf, _cpu_storage_at(zf)) is NotImplemented
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    fp_core.load_into(target, big)
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    assert all(torch.equal(a, b) for a, b in zip(fp_core.load(big, weights_only=True).values(), state.values()))
    # A byteorder record that is neither: torch's own error, never a crash (torch's unpickler
    # segfaults byte-swapping a meta storage, so load_into never hands it such a file).
    odd = str(tmp_path / "odd.pt")
    with zipfile.ZipFile(big) as zin, zipfile.ZipFile(odd, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, b"middle" if info.filename.endswith("/byteorder") else zin.read(info))
    with pytest.raises(ValueError, match="endianness"):
        fp_core.load_into(target, odd)


def test_a_pickle_that_calls_a_storage_class_is_refused_as_torch_refuses_it(tmp_path):
    """The storage class names resolve to torch's uncallable StorageType, as in torch's own
    unpicklers: a pickle constructing a storage (of any size it likes) is refused, never
    run."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    path = str(tmp_path / "calls-storage.pt")
    call = b"\x80\x02ctorch\nFloatStorage\nJ\x00\x00\x00\x40\x85R."  # torch.FloatStorage(2**30)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, call if info.filename.endswith("data.pkl") else zin.read(info))
    with _zip_reader(path) as zf:
        assert plain_unpickle.unpickle(zf, _cpu_storage_at(zf)) is NotImplemented
    for wo in (True, False):
        with pytest.raises(TypeError, match="not callable"):
            torch.load(path, weights_only=wo)
        with pytest.raises(TypeError, match="not callable"):
            fp_core.load(path, weights_only=wo)


def test_only_torch_saves_protocol_is_read_fast(tmp_path):
    """A pickle of another protocol than torch.save's goes to torch's unpickler, which
    answers as torch.load does (its weights-only unpickler refuses protocol 4)."""
    path = str(tmp_path / "p4.pt")
    state = {"w": torch.arange(6.0), "n": 3}
    torch.save(state, path, pickle_protocol=4)
    with _zip_reader(path) as zf:
        assert plain_unpickle.unpickle(zf, _cpu_storage_at(zf)) is NotImplemented
    with pytest.raises(pickle.UnpicklingError):  # torch's weights-only unpickler reads protocol 2 only
        torch.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError):
        fp_core.load(path, weights_only=True)
    got = fp_core.load(path, weights_only=False)
    assert torch.equal(got["w"], state["w"]) and got["n"] == 3


def _flat(obj, out):
    if isinstance(obj, dict):
        for v in obj.values():
            _flat(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _flat(v, out)
    else:
        out.append(obj)
    return out


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_structure_describes_each_tensor_as_torch_load_builds_it(tmp_path, writer):
    """load_into's structure: a SavedTensor per tensor, with torch.load's dtype, shape,
    strides, storage offset and contiguity, its storage's bytes at its offset in the file,
    and one offset for tensors of one storage."""
    from fp_core.loading.file_image import storage_entries
    from fp_core.loading.integrity import CheckpointFile

    state = _plain_state()
    path = str(tmp_path / "s.pt")
    torch.save(state, path) if writer == "torch" else fp_core.save(state, path)
    expected = torch.load(path, weights_only=True)
    with open(path, "rb") as f:
        raw = f.read()
    with CheckpointFile(path) as cf:
        entries = storage_entries(cf)
        offsets = {i.filename.partition("/")[2]: off for i, off in zip(entries, cf.data_offsets(entries))}
    with _zip_reader(path) as zf:
        saved = plain_unpickle.structure(zf, offsets)
    assert saved is not NotImplemented
    assert saved["meta"] == state["meta"]
    by_storage = {}
    for s, t in zip(_flat(saved, []), _flat(expected, [])):
        if not isinstance(t, torch.Tensor):
            assert s == t
            continue
        assert isinstance(s, plain_unpickle.SavedTensor)
        assert (s.dtype, s.shape, s.stride, s.storage_offset) == (t.dtype, tuple(t.shape), t.stride(),
                                                                  t.storage_offset())
        assert s.is_contiguous() == t.is_contiguous() and s.numel() == t.numel()
        st = t.untyped_storage()
        assert s.storage_nbytes == st.nbytes()
        assert raw[s.offset:s.offset + s.storage_nbytes] == bytes(st)  # its storage's bytes lie there
        assert by_storage.setdefault(st.data_ptr(), s.offset) == s.offset


def test_a_view_outside_its_storage_is_not_plain():
    """What torch's set_ refuses is not described here either: torch's unpickler answers."""
    st = plain_unpickle._SavedStorage(4096, 40, torch.float32)  # 10 floats
    ok = plain_unpickle._saved_tensor(st, 2, (2, 4), (4, 1), False, collections.OrderedDict())
    assert ok.numel() == 8 and ok.is_contiguous()
    assert not plain_unpickle._saved_tensor(st, 0, (4, 2), (1, 4), False, collections.OrderedDict()).is_contiguous()
    assert plain_unpickle._saved_tensor(st, 99, (0,), (1,), False, collections.OrderedDict()).numel() == 0
    for args in [(3, (2, 4), (4, 1), False),  # one element past the end
                 (0, (11,), (1,), False), (0, (2,), (-1,), False), (-1, (2,), (1,), False),
                 (0, (2,), (1, 1), False), (0, [2], [1], False), (0, (2.0,), (1,), False), (0, (2,), (1,), 1)]:
        with pytest.raises(plain_unpickle.NotPlain):
            plain_unpickle._saved_tensor(st, *args, collections.OrderedDict())
    with pytest.raises(plain_unpickle.NotPlain):  # hooks
        plain_unpickle._saved_tensor(st, 0, (2,), (1,), False, collections.OrderedDict(a=1))
