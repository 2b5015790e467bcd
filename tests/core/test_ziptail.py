"""fp_core.format.ziptail: reading torch's central directory and appending the manifest record."""

from __future__ import annotations

import io
import zipfile

import pytest

from fp_core.format import ziptail
from fp_core.format.skeleton import SparseFile


def _zip_into_sparse(names_data: list[tuple[str, bytes]]) -> SparseFile:
    sf = SparseFile()
    with zipfile.ZipFile(sf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in names_data:
            z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return sf


def _as_bytes(sf: SparseFile) -> bytes:
    return sf.pread(0, sf.size)


def _check_roundtrip(items: list[tuple[str, bytes]]) -> None:
    sf = _zip_into_sparse(items)
    d = ziptail.read_directory(sf)
    with zipfile.ZipFile(io.BytesIO(_as_bytes(sf))) as z:
        infos = z.infolist()
    assert [(e.name, e.header_offset, e.file_size) for e in d.entries] == \
        [(i.filename, i.header_offset, i.file_size) for i in infos]
    for e, (_, payload) in zip(d.entries, items):
        off = ziptail.local_data_offset(sf, e.header_offset)
        assert sf.pread(off, len(payload)) == payload

    added = ziptail.append_stored(sf, d, "archive/.fastpersist/manifest.json", b"{ }   ", b"comment-12345678")
    data = _as_bytes(sf)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None  # every CRC-32 right, the new one included
        assert [i.filename for i in z.infolist()] == [n for n, _ in items] + ["archive/.fastpersist/manifest.json"]
        for name, payload in items:
            assert z.read(name) == payload
        assert z.read("archive/.fastpersist/manifest.json") == b"{ }   "
        assert z.comment == b"comment-12345678"
        info = z.getinfo("archive/.fastpersist/manifest.json")
        assert info.header_offset == added.header_offset
    assert data[added.data_offset: added.data_offset + 6] == b"{ }   "
    assert int.from_bytes(data[added.central_entry: added.central_entry + 4], "little") == 0x02014B50
    assert data.endswith(b"comment-12345678")


def test_read_and_append_small_zip():
    _check_roundtrip([("archive/data.pkl", b"pickle" * 10), ("archive/data/0", b""), ("archive/version", b"3\n")])


def test_more_than_65535_entries_uses_zip64_end_records():
    items = [(f"archive/data/{i}", bytes([i % 251])) for i in range(65_600)]
    _check_roundtrip(items)


def test_not_a_zip_is_refused():
    sf = SparseFile()
    sf.write(b"not a zip at all" * 10)
    with pytest.raises(ValueError, match="end-of-central-directory"):
        ziptail.read_directory(sf)


def _relayout_torch_skeleton(obj, residues_by_key, modulus=4096):
    import torch

    from fp_core.format.skeleton import capture

    sf, storages = capture(obj, 4096)
    d = ziptail.read_directory(sf)
    prefix = d.entries[0].name.split("/", 1)[0]
    residues = {f"{prefix}/data/{k}": residues_by_key(k, storages[k][0]) for k in storages}
    moved = SparseFile()
    nd = ziptail.relayout(sf, d, moved, residues, modulus)
    assert torch is not None
    return sf, d, moved, nd, residues


def test_relayout_moves_records_to_their_residues_and_keeps_everything_else():
    import torch

    obj = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.ones(3, 5), "note": "text" * 50,
           "c": torch.zeros(0)}
    want = {"0": 64, "1": 4032, "2": 100}
    sf, d, moved, nd, residues = _relayout_torch_skeleton(obj, lambda k, s: want.get(k, 0))
    assert [e.name for e in nd.entries] == [e.name for e in d.entries]
    old = {e.name: e for e in d.entries}
    for e in nd.entries:
        data = ziptail.local_data_offset(moved, e.header_offset)
        mod = 4096 if e.name in residues else 64
        assert data % mod == (residues.get(e.name, 0) % mod), e.name
        o = old[e.name]
        before = sf.pread(ziptail.local_data_offset(sf, o.header_offset), o.file_size)
        assert moved.pread(data, e.file_size) == before, e.name  # record bytes (holes read as zeros)
    # zipfile reads the new directory and headers: names, sizes and offsets agree.
    with zipfile.ZipFile(io.BytesIO(_as_bytes(moved))) as z:
        infos = z.infolist()
    assert [(i.filename, i.header_offset, i.file_size) for i in infos] == \
        [(e.name, e.header_offset, e.file_size) for e in nd.entries]
    # Storage bytes stay holes: the relaid skeleton costs no more memory than the first.
    stored = sum(len(b) for _, b in moved.segments())
    assert stored < sum(len(b) for _, b in sf.segments()) + 4096


def test_relayout_across_4gib_writes_zip64_offsets():
    import torch

    big = torch.empty(int(4.2 * (1 << 30)), dtype=torch.uint8)  # never touched: no memory
    obj = {"big": big, "after": torch.arange(7), "later": torch.ones(2)}
    sf, d, moved, nd, residues = _relayout_torch_skeleton(obj, lambda k, s: 64)
    with zipfile.ZipFile(moved) as z:  # reads only the headers and the directory
        infos = {i.filename: i for i in z.infolist()}
    assert any(i.header_offset > (1 << 32) for i in infos.values())
    for e in nd.entries:
        assert infos[e.name].header_offset == e.header_offset
        if e.name in residues:
            assert ziptail.local_data_offset(moved, e.header_offset) % 4096 == 64
    assert ziptail.read_directory(moved).entries == nd.entries
