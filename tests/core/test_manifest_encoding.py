"""The manifest's hand-written encoder writes exactly json.dumps's bytes, and they parse back."""

from __future__ import annotations

import json
import random

from fp_core.format.manifest import FORMAT, Manifest, RecordInfo

NAMES = ["archive/data/0", "layer.0.weight", 'quote"back\\slash', "tab\tnew\nline\x00\x1f", "ünïcødé 名前",
         "emoji 🚀", "lone \ud800 surrogate", "", "/", "a" * 300, "100% %s %08x %%"]


def _reference(m: Manifest) -> bytes:
    doc = {"format": FORMAT, "checksum": "crc32c", "file_size": m.file_size, "alignment": m.alignment,
           "structure_crc32c": f"{m.structure_crc32c:08x}",
           "records": [{"name": r.name, "kind": r.kind, "offset": r.offset, "size": r.size, "crc32c": f"{r.crc32c:08x}",
                        **({"tensor": r.tensor} if r.tensor is not None else {}),
                        **({"dtype": r.dtype} if r.dtype is not None else {})} for r in m.records]}
    return json.dumps(doc, separators=(",", ":")).encode()


def test_encoder_matches_json_dumps_byte_for_byte():
    rng = random.Random(7)
    for trial in range(300):
        records = [RecordInfo(rng.choice([n for n in NAMES if n]),  # the parser wants a name
                               rng.randrange(1 << 45), rng.randrange(1 << 40), rng.randrange(1 << 32),
                              tensor=rng.choice(NAMES + [None]), dtype=rng.choice(["float32", "bfloat16", None]),
                              kind=rng.choice(["storage", "record"]))
                   for _ in range(rng.randrange(0, 12))]
        m = Manifest(rng.randrange(1 << 50), 1 << rng.randrange(0, 21), records, rng.randrange(1 << 32))
        assert m.to_bytes() == _reference(m), trial
        reserved = m.reserved_size()
        padded = m.to_bytes(pad_to=reserved)
        assert len(padded) == reserved
        back = Manifest.from_bytes(padded)
        assert back.records == records and back.file_size == m.file_size, trial
        # frozen (a plan's records, final but for their CRCs): the same bytes as the CRCs change
        m.freeze()
        for r in records:
            r.crc32c = rng.randrange(1 << 32)
        assert m.to_bytes() == _reference(m), trial
        assert m.reserved_size() == reserved, trial
        if records:  # a record added or replaced after freezing is rendered, not left out
            m.records.append(RecordInfo("late%s", 1, 2, 3, kind="record"))
            assert m.to_bytes() == _reference(m), trial
            m.freeze()
            m.records[0] = RecordInfo("swapped", 5, 6, 7, kind="record")
            assert m.to_bytes() == _reference(m), trial
