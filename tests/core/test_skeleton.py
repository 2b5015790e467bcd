"""SparseFile: the skeleton capture's file object must behave as a real file for every write pattern."""

from __future__ import annotations

import os
import random

from fp_core.format.skeleton import SparseFile


def test_sparse_file_matches_a_real_buffer_under_random_writes():
    rng = random.Random(1)
    for trial in range(2000):
        sf, ref, written = SparseFile(), bytearray(400), [False] * 400
        for _ in range(rng.randint(1, 12)):
            off, n = rng.randint(0, 350), rng.randint(0, 40)
            data = bytes(rng.randrange(256) for _ in range(n))
            sf.seek(off)
            sf.write(data)
            ref[off : off + n] = data
            written[off : off + n] = [True] * n
        assert sf.pread(0, 400) == bytes(ref), trial
        segs = sf.segments()
        assert all(a + len(da) <= b for (a, da), (b, _) in zip(segs, segs[1:])), trial
        covered = [False] * 400
        for a, da in segs:
            covered[a : a + len(da)] = [True] * len(da)
        assert covered == written, trial  # holes stay holes: nothing is materialised


def test_gather_joins_the_written_parts_of_a_range_as_views_in_finds_them():
    """The writer hands the skeleton's bytes of a range to the engine as one buffer and a
    list of (offset, length): the same bytes, at the same places, as the views it replaced,
    for ranges that start and end inside segments, in holes, and past the end."""
    rng = random.Random(2)
    for trial in range(1000):
        sf = SparseFile()
        for _ in range(rng.randint(0, 10)):
            sf.seek(rng.randint(0, 350))
            sf.write(bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))))
        off, n = rng.randint(0, 420), rng.randint(0, 420)
        blob, where = sf.gather(off, n)
        views = sf.views_in(off, n)
        assert where == [(rel, len(v)) for rel, v in views], trial
        assert blob == b"".join(bytes(v) for _, v in views), trial
        at = 0
        for rel, m in where:  # each piece is the file's bytes at that offset
            assert blob[at: at + m] == sf.pread(off + rel, m), trial
            at += m


def test_seek_past_end_makes_a_hole_not_bytes():
    sf = SparseFile()
    sf.write(b"head")
    sf.seek(1 << 40, 1)  # a 1 TiB storage skipped by torch
    sf.write(b"tail")
    assert sf.size == 4 + (1 << 40) + 4
    assert [len(d) for _, d in sf.segments()] == [4, 4]


def _varied_state() -> dict:
    """Tensors of every kind a checkpoint holds, and the kinds the fast reduction must leave to torch."""
    import collections

    import torch

    base = torch.arange(64, dtype=torch.float32)
    tagged = torch.ones(3)
    tagged.note = "python attribute"  # pickled through torch's _rebuild_from_type_v2
    hooked = torch.ones(2, requires_grad=True)
    hooked.register_hook(lambda g: g)
    sd = collections.OrderedDict()
    sd._metadata = {"": {"version": 1}}
    sd.update({
        "w": torch.randn(5, 7),
        "half": torch.randn(4, dtype=torch.float16), "bf16": torch.randn(4, dtype=torch.bfloat16),
        "i64": torch.arange(9), "flag": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3), "view_a": base[3:10], "view_b": base.view(8, 8).t(),
        "same": base, "grad": torch.ones(3, requires_grad=True), "param": torch.nn.Parameter(torch.ones(2)),
        "tagged": tagged, "u16": torch.arange(5).to(torch.uint16), "conj": torch.randn(3, dtype=torch.cfloat).conj(),
        "cplx": torch.randn(2, dtype=torch.cdouble), "neg": torch.randn(2, dtype=torch.cfloat)._neg_view(),
    })
    optim = {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(5, 7)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}
    return {"state_dict": sd, "optimizer": optim, "epoch": 3, "name": "run", "hooked": hooked}


def test_fast_tensor_reduction_writes_torchs_bytes_exactly():
    import warnings

    from fp_core.format.skeleton import capture

    obj = _varied_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the hooked tensor's hooks
        fast, fast_storages = capture(obj, 4096, fast_tensors=True)
        slow, slow_storages = capture(obj, 4096, fast_tensors=False)
    assert fast.size == slow.size
    assert fast.segments() == slow.segments()  # every header and the pickle byte for byte
    assert {k: (s.data_ptr(), d, n) for k, (s, d, n) in fast_storages.items()} == \
        {k: (s.data_ptr(), d, n) for k, (s, d, n) in slow_storages.items()}
    assert len(fast_storages) < len(obj["state_dict"]) + 3  # base's three views share one storage


def test_fast_tensor_reduction_takes_only_plain_cpu_tensors():
    import warnings

    import torch

    from fp_core.format.skeleton import fast_tensor_reduce

    state = _varied_state()
    sd = state["state_dict"]
    taken = {k for k, v in sd.items() if fast_tensor_reduce(v) is not NotImplemented}
    assert taken == {"w", "half", "bf16", "i64", "flag", "scalar", "empty", "view_a", "view_b", "same", "grad",
                     "cplx"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fast_tensor_reduce(state["hooked"]) is NotImplemented
    for v in (torch.empty(2, device="meta"), torch.ones(3).to_sparse(), [1], "s", torch.float32):
        assert fast_tensor_reduce(v) is NotImplemented
    for key in taken:  # the very tuple torch builds, storage wrapper aside
        (func, args), (tfunc, targs) = fast_tensor_reduce(sd[key]), sd[key].__reduce_ex__(2)
        assert func is tfunc and args[1:] == targs[1:], key
        assert (args[0].dtype, args[0]._untyped_storage.data_ptr(), args[0]._size()) == \
            (targs[0].dtype, targs[0]._untyped_storage.data_ptr(), targs[0]._size()), key


def test_varied_state_round_trips_through_fp_core_save(disk_dir):
    import warnings

    import torch

    import fp_core

    obj = _varied_state()
    path = os.path.join(disk_dir, "varied.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp_core.save(obj, path)
    got = torch.load(path, weights_only=False)
    fp_core.verify(path)
    for key, want in obj["state_dict"].items():
        have = got["state_dict"][key]
        assert type(have) is type(want) and have.dtype == want.dtype, key
        assert have.is_conj() == want.is_conj() and have.is_neg() == want.is_neg(), key
        assert have.requires_grad == want.requires_grad and have.stride() == want.stride(), key
        assert torch.equal(have.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg()), key
    assert got["state_dict"]["tagged"].note == "python attribute"
    assert got["state_dict"]._metadata == {"": {"version": 1}}
    assert got["state_dict"]["view_a"].untyped_storage().data_ptr() == got["state_dict"]["same"].untyped_storage().data_ptr()
    assert got["optimizer"]["param_groups"] == obj["optimizer"]["param_groups"] and got["epoch"] == 3


def test_truncate_matches_a_real_buffer():
    rng = random.Random(5)
    for trial in range(1000):
        sf, ref = SparseFile(), bytearray()
        for _ in range(rng.randint(1, 8)):
            off, n = rng.randint(0, 300), rng.randint(1, 40)
            data = bytes(rng.randrange(1, 256) for _ in range(n))
            sf.seek(off)
            sf.write(data)
            ref.extend(bytes(max(0, off + n - len(ref))))
            ref[off : off + n] = data
        cut = rng.randint(0, 360)
        assert sf.truncate(cut) == cut and sf.size == cut
        want = bytes(ref[:cut]) + bytes(max(0, cut - len(ref)))
        assert sf.pread(0, cut) == want, trial
        assert all(a + len(d) <= cut for a, d in sf.segments()), trial
