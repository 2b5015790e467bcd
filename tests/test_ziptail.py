"""fp_core.ziptail: reading torch's central directory and appending the manifest record."""

from __future__ import annotations

import io
import zipfile

import pytest

from fp_core import ziptail
from fp_core.skeleton import SparseFile


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
