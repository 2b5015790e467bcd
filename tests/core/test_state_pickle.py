"""state_pickle writes torch.save's pickle of a plain state without a pickler: it must be
torch's bytes exactly, for every kind of object it takes, and leave everything else to torch."""

from __future__ import annotations

import collections
import io
import math
import pickle

import pytest
import torch

from fp_core.format import state_pickle
from fp_core.format.plan import tensor_names
from fp_core.format.skeleton import capture, torch_capture


def _torch_pickle(obj) -> bytes:
    """data.pkl as torch.save writes it (torch's pickler, torch's tensor reduction)."""
    with torch.serialization.skip_data():
        buf = io.BytesIO()
        torch.save(obj, buf)
    import zipfile

    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return z.read(name)


def _assert_torchs_bytes(obj) -> None:
    names: dict = {}
    data, storages = state_pickle.dumps(obj, names)
    assert data == _torch_pickle(obj)
    assert names == tensor_names(obj)  # the manifest names tensors as the walk over the object does
    fast, fast_storages = capture(obj, 4096, fast_tensors=True)
    slow, slow_storages = capture(obj, 4096, fast_tensors=False)
    assert fast.size == slow.size and fast.segments() == slow.segments()  # the whole zip skeleton too
    assert [(k, s.data_ptr(), d, n) for k, (s, d, n) in fast_storages.items()] == \
        [(k, s.data_ptr(), d, n) for k, (s, d, n) in slow_storages.items()] == \
        [(k, s.data_ptr(), d, n) for k, (s, d, n) in storages.items()]
    # on_storage (a sync save's early write) hears of each storage once, in key order, as
    # torch's pickler reports them (fast or not).
    for heard_of in (lambda cb: state_pickle.dumps(obj, on_storage=cb),
                     lambda cb: torch_capture(obj, 4096, on_storage=cb),
                     lambda cb: torch_capture(obj, 4096, fast_tensors=False, on_storage=cb)):
        heard: list = []
        heard_of(lambda key, entry, heard=heard: heard.append((key, entry[0]._cdata, entry[2])))
        assert heard == [(k, s._cdata, n) for k, (s, _, n) in storages.items()]


def _module_and_optimizer_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "global_step": 1200}


def test_module_and_optimizer_state_is_torchs_pickle():
    state = _module_and_optimizer_state()
    assert type(state["model"]) is collections.OrderedDict and state["model"]._metadata  # pickled with BUILD
    _assert_torchs_bytes(state)
    _assert_torchs_bytes(state["model"])


@pytest.mark.parametrize("n", [0, 1, 2, 999, 1000, 1001, 2000, 2001])
def test_container_batching_is_the_c_picklers(n):
    # dicts, OrderedDicts and lists batch their items in 1000s, each in its own way.
    keys = [f"k{i}" for i in range(n)]
    _assert_torchs_bytes({k: i for i, k in enumerate(keys)})
    _assert_torchs_bytes(collections.OrderedDict((k, torch.ones(1)) for k in keys))
    _assert_torchs_bytes(list(range(n)))
    _assert_torchs_bytes(tuple(range(min(n, 5))))


def test_scalars_and_strings_are_the_c_picklers():
    ints = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -128, -129, -256, -2**31, -2**31 - 1,
            2**63, -2**63, 2**64 - 1, 2**2100, -2**2100, 127 << 56, -(128 << 56)]
    floats = [0.0, -0.0, 1.5, -1e300, math.inf, -math.inf, math.nan, 5e-324]
    strings = ["", "a", "0", "cpu", "storage", "ü", "日本語", "\ud800 lone surrogate", "x" * 70000]
    _assert_torchs_bytes({"ints": ints, "floats": floats, "strings": strings, "flags": [True, False, None],
                          "nested": ((1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ())})


def test_memo_beyond_256_entries_and_shared_objects():
    shared_str = "shared-" + "value"  # one object, referenced many times: BINGET after the first
    shared_tuple = (0.9, 0.999)
    groups = [{"betas": shared_tuple, "name": shared_str, "params": list(range(i, i + 3))} for i in range(400)]
    t = torch.randn(3)
    state = {"groups": groups, "same_tensor": [t, t, {"again": t}], "same_list": [groups[0]["params"]] * 3}
    _assert_torchs_bytes(state)


def test_storage_keys_and_string_identity_match_torch():
    # torch names storages "0", "1", ...: one-character strings are interned singletons, so a
    # state key "0" is the very object torch's pickler memoises for storage "0".
    _assert_torchs_bytes({"0": torch.ones(2), "1": torch.zeros(3), 0: "0", "cpu": "cpu", "storage": "storage"})


def test_every_tensor_layout_a_state_holds():
    base = torch.arange(10000, dtype=torch.float32)
    state = {
        "view": base[300:9000].view(87, 100), "strided": base[::3], "t": base[:600].view(20, 30).t(),
        "same": base, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3), "zero_numel_offset": base[10:10],
        "grad": torch.ones(4, requires_grad=True), "big_dims": torch.empty(70000, 1).expand(70000, 3),
        "dims5": torch.ones(1, 2, 1, 2, 1),
    }
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
                  torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128):
        state[str(dtype)] = torch.zeros(3, dtype=dtype)
    _assert_torchs_bytes(state)


def test_a_cycle_is_pickled_as_torch_does():
    d: dict = {"t": torch.ones(2)}
    d["self"] = d
    lst: list = [1]
    lst.append(lst)
    _assert_torchs_bytes({"d": d, "l": lst})


@pytest.mark.parametrize("make", [
    lambda: {"p": torch.nn.Parameter(torch.ones(2))},
    lambda: {"n": __import__("numpy").ones(2)},
    lambda: {"b": b"bytes"},
    lambda: {"s": {1, 2}},
    lambda: {"d": torch.float32},
    lambda: {"u16": torch.arange(3).to(torch.uint16)},
    lambda: {"sub": collections.defaultdict(int)},
    lambda: {"meta": torch.empty(2, device="meta")},
    lambda: {"conj": torch.randn(2, dtype=torch.cfloat).conj()},
    lambda: {"sparse": torch.ones(2).to_sparse()},
    lambda: {"ex": ValueError("x")},
], ids=["parameter", "numpy", "bytes", "set", "dtype", "uint16", "dict-subclass", "meta", "conj", "sparse",
        "exception"])
def test_anything_else_is_left_to_torch(make):
    obj = make()
    with pytest.raises(state_pickle.NotPlainState):
        state_pickle.dumps(obj)
    fast, _ = capture(obj, 4096, fast_tensors=True)  # torch's own pickler, same file
    slow, _ = capture(obj, 4096, fast_tensors=False)
    assert fast.segments() == slow.segments()


def test_a_tensor_with_attributes_is_left_to_torch():
    t = torch.ones(2)
    t.note = "x"
    with pytest.raises(state_pickle.NotPlainState):
        state_pickle.dumps({"t": t})


def test_nesting_too_deep_gets_torchs_own_error():
    deep: list = []
    cur = deep
    for _ in range(5000):
        cur.append([])
        cur = cur[0]
    with pytest.raises(state_pickle.NotPlainState):
        state_pickle.dumps(deep)
    with pytest.raises(RecursionError):  # what torch.save of it raises
        torch.save(deep, io.BytesIO())
    with pytest.raises(RecursionError):  # torch's pickler ran: the same error, not ours
        capture(deep, 4096)


def test_two_dtypes_over_one_storage_raise_torchs_error():
    t = torch.ones(4)
    obj = {"f": t, "i": t.view(torch.int32)}
    with pytest.raises(state_pickle.NotPlainState):
        state_pickle.dumps(obj)
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        capture(obj, 4096)


def test_the_pickle_loads_with_weights_only(tmp_path):
    import fp_core

    state = _module_and_optimizer_state()
    path = str(tmp_path / "s.pt")
    fp_core.save(state, path)
    got = torch.load(path, weights_only=True)
    assert got["epoch"] == 3 and got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v)
    assert got["model"]._metadata == state["model"]._metadata
    assert pickle.loads(state_pickle.dumps({"x": [1, "a", 2.5]})[0]) == {"x": [1, "a", 2.5]}


def test_a_plain_state_is_packed_on_torchs_alignment_and_loads_every_way(tmp_path):
    import fp_core
    from fp_core.format.plan import PLAIN_STORAGE_ALIGNMENT, build

    torch.manual_seed(1)
    state = {f"layer{i}.{k}": torch.randn(n) for i in range(300) for k, n in (("w", 37), ("b", 5))}
    state["big"] = torch.randn(3 << 20)
    packed = build(state, 4096)
    offsets = [s.offset for s in packed.storages]
    assert all(o % PLAIN_STORAGE_ALIGNMENT == 0 for o in offsets)
    assert any(o % 4096 for o in offsets)  # not padded to blocks
    param_state = dict(state, p=torch.nn.Parameter(torch.ones(2)))  # not plain: torch's pickler, block-aligned
    assert all(s.offset % 4096 == 0 for s in build(param_state, 4096).storages)
    assert packed.file_size < build(param_state, 4096).file_size - 300 * 4096
    few_large = {"a": torch.randn(1 << 20), "b": torch.randn(300_001), "c": torch.randn(7)}
    assert all(s.offset % 4096 == 0 for s in build(few_large, 4096).storages)  # padding is cheap: blocks
    assert all(s.offset % 4096 == s.addr() % 4096 for s in build(state, 4096, congruent=True).storages
               if s.length >= 4096)  # the async layout is unchanged

    path = str(tmp_path / "packed.pt")
    fp_core.save(state, path)
    fp_core.verify(path)
    for got in (torch.load(path, weights_only=True), torch.load(path, mmap=True, weights_only=True),
                fp_core.load(path), fp_core.load(path, verify=True)):
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    fp_core.load_into(into, path)
    assert all(torch.equal(into[k], v) for k, v in state.items())
