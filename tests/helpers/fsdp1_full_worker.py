"""A rank of the FlatShard / FSDP1-full tests: every rank writes its own element ranges of
one torch.save file of the full state, from FSDP1's flat-param shards, with no gather.

Usage: python fsdp1_full_worker.py RANK WORLD PORT DIR SCENARIO (conftest.run_ranks); each
rank reports to DIR/result<RANK>.json. SCENARIO ``all`` runs every check in one launch
(the suite's time): FSDP1 with use_orig_params True and False against its
FULL_STATE_DICT gather, counting the collectives of the save; uneven and empty ranges;
a gap and an overlap refused; an async save.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import join, reported  # noqa: E402
from sharded_file_fsdp1_worker import differ  # noqa: E402

import fp_core  # noqa: E402
from fp_core.format.flat_shard import FlatShard  # noqa: E402
from fp_core.parallel.sharded_file import fsdp1_flat  # noqa: E402

# What the collectives of torch.distributed may be called by a save: the wrapped names.
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "gather",
               "gather_object", "broadcast", "broadcast_object_list", "all_reduce", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "scatter_object_list",
               "send", "recv", "isend", "irecv", "barrier", "monitored_barrier")


def _has_tensor(obj, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 50:
        return False
    if isinstance(obj, dict):
        return any(_has_tensor(k, depth + 1) or _has_tensor(v, depth + 1) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        return any(_has_tensor(v, depth + 1) for v in obj)
    if hasattr(obj, "__dict__"):
        return _has_tensor(vars(obj), depth + 1)
    return False


class Collectives:
    """Every outermost torch.distributed collective called while active: its name, whether
    it carried tensor data (a tensor collective, or an object one whose objects hold a
    tensor) and its payload's size (objects: their pickle)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, int]] = []
        self._depth = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> Collectives:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        def call(*args, **kwargs):
            if self._depth == 0:
                payload = list(args) + list(kwargs.values())
                if name.endswith("_object") or name.endswith("_object_list"):
                    objs = [a for a in payload if isinstance(a, (list, dict, tuple)) or not hasattr(a, "rank")]
                    tensor = _has_tensor(objs)
                    try:
                        size = len(pickle.dumps(objs))
                    except Exception:  # noqa: BLE001 - a group handle in the payload
                        size = -1
                else:
                    tensors = [a for a in payload if isinstance(a, torch.Tensor)]
                    tensors += [t for a in payload if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
                    tensor = bool(tensors)
                    size = sum(t.numel() * t.element_size() for t in tensors)
                self.calls.append((name, tensor, size))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return call


class OddEq(torch.nn.Module):
    """A module whose ``==`` builds another object (as torchmetrics' metrics do)."""

    __hash__ = torch.nn.Module.__hash__

    def forward(self, x):
        return x

    def __eq__(self, other):
        return OddEq()


def fsdp1_model(use_orig_params: bool, optimizer: type = torch.optim.Adam):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    # 13x37 + 37 and 37x5 + 5: flat params that divide by neither rank count, a parameter cut
    # between the ranks mid-row, a parameter on one rank only; a buffer at the root
    net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5),
                              torch.nn.LayerNorm(5), torch.nn.Linear(5, 300), OddEq())
    net.register_buffer("counts", torch.arange(4096, dtype=torch.int64))
    net.register_buffer("scratch", torch.ones(2), persistent=False)
    model = FSDP(net, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 use_orig_params=use_orig_params)
    with torch.no_grad():  # FSDP never syncs buffers: the ranks' copies differ in one element
        net.counts[17] = 1000 + dist.get_rank()
    opt = optimizer(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        model(torch.randn(4, 13, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def full_gather(model, opt) -> dict:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        return {"state_dict": model.state_dict(), "optimizer_states": [FSDP.optim_state_dict(model, opt)],
                "epoch": 7}


def fsdp1_check(d: str, use_orig_params: bool, result: dict, optimizer: type = torch.optim.Adam) -> None:
    """The FlatShard state of an FSDP1 model + Adam (or another optimizer) after 3 steps,
    saved as one file with layout="file", is what its FULL_STATE_DICT gather is, byte for
    byte (keys in order, dtypes, shapes, values; buffers as rank 0 holds them, which stock
    writes), and the save carries no tensor between ranks."""
    tag = f"uop{int(use_orig_params)}" + ("" if optimizer is torch.optim.Adam else f"_{optimizer.__name__}")
    model, opt = fsdp1_model(use_orig_params, optimizer)
    assert fsdp1_flat.unsupported(model, [opt]) is None
    path = os.path.join(d, f"{tag}.pt")
    with Collectives() as seen:
        state = {"state_dict": fsdp1_flat.model_state(model),
                 "optimizer_states": [fsdp1_flat.optimizer_state(model, opt)], "epoch": 7}
        st = fp_core.save(state, path, layout="file")
    result[f"{tag}_collectives"] = seen.calls
    result[f"{tag}_data_bytes"] = st.extra["data_bytes"]
    result[f"{tag}_flat"] = sum(isinstance(v, FlatShard) for v in state["state_dict"].values())
    full = full_gather(model, opt)
    full["state_dict"]["counts"][17] = 1000  # rank 0's buffer: stock's file is rank 0's gather
    dist.barrier()
    got = torch.load(path, weights_only=True)
    result[f"{tag}_differ"] = differ(full, got)
    result[f"{tag}_keys"] = list(got["state_dict"])
    result[f"{tag}_metadata"] = got["state_dict"]._metadata == full["state_dict"]._metadata
    result[f"{tag}_optim_keys"] = list(got["optimizer_states"][0]["state"])
    result[f"{tag}_verified"] = fp_core.verify(path)["bytes"] > 0
    full_bytes = sum(v.numel() * v.element_size() for v in full["state_dict"].values())
    full_bytes += sum(v.numel() * v.element_size() for s in full["optimizer_states"][0]["state"].values()
                      for v in s.values())
    result[f"{tag}_full_bytes"] = full_bytes


def synthetic(gen: int = 0) -> dict:
    """Full tensors every rank builds alike (their FlatShards cut from them)."""
    g = torch.Generator().manual_seed(99 + gen)
    return {"w": torch.randn(37, 5, generator=g), "emb": torch.randn(11, 3, 2, generator=g).to(torch.bfloat16),
            "ids": torch.arange(23, dtype=torch.int64) * (gen + 1), "big": torch.randn(600, 1024, generator=g),
            "one": torch.randn(1, generator=g), "zero": torch.empty(0, 4), "buf": torch.arange(5.0) + gen}


# Each tensor's split point between rank 0 and rank 1 (elements): mid-row, all on rank 1 (rank
# 0 empty), all on rank 0, on a block boundary of neither rank, the single element on rank 1.
SPLITS = {"w": 96, "emb": 0, "ids": 23, "big": 600 * 1024 // 2 + 3, "one": 0, "zero": 0}


def flat_state(full: dict, rank: int) -> dict:
    """``full`` as FlatShards: rank 0 elements [0, split), rank 1 [split, numel); ``buf`` plain."""
    out = {}
    for k, v in full.items():
        if k == "buf":
            out[k] = v
            continue
        lo, hi = (0, SPLITS[k]) if rank == 0 else (SPLITS[k], v.numel())
        # a view into a larger tensor on purpose: the FlatShard's bytes are only its range
        out[k] = FlatShard(v.reshape(-1)[lo:hi], v.shape, lo)
    return {"model": out, "step": 3}


def ranges_check(d: str, rank: int, result: dict) -> None:
    """Uneven and empty ranges make the full file; a gap or an overlap is refused on every
    rank, naming the tensor, with nothing written and the previous file intact."""
    full = synthetic()
    path = os.path.join(d, "flat.pt")
    st = fp_core.save(flat_state(full, rank), path, layout="file")
    result["flat_data_bytes"] = st.extra["data_bytes"]
    dist.barrier()
    result["flat_differ"] = differ({"model": full, "step": 3}, torch.load(path, weights_only=True))
    result["flat_verified"] = fp_core.verify(path)["bytes"] > 0
    before = hashlib.sha256(open(path, "rb").read()).hexdigest()
    listing = sorted(os.listdir(d))
    dist.barrier()  # both looked before rank 0 makes the next save's temp file
    errors = {}
    for name in ("gap", "overlap", "mixed"):
        bad = flat_state(synthetic(1), rank)
        if rank == 1:
            w = full["w"].reshape(-1)
            lo = 100 if name == "gap" else 90  # rank 0 ends at 96: elements 96..99 missing, or 90..95 twice
            # mixed: rank 1 holds the whole tensor, plain, where rank 0 holds a FlatShard
            bad["model"]["w"] = full["w"] if name == "mixed" else FlatShard(w[lo:], full["w"].shape, lo)
        try:
            fp_core.save(bad, path, layout="file")
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[name] = f"{type(e).__name__}: {e}"
        dist.barrier()
    result["tiling_errors"] = errors
    result["unchanged"] = hashlib.sha256(open(path, "rb").read()).hexdigest() == before
    result["listing_same"] = sorted(os.listdir(d)) == listing
    try:
        FlatShard(torch.zeros(5), (2, 2), 0)
        result["outside"] = None
    except ValueError as e:
        result["outside"] = str(e)
    try:
        fp_core.save(flat_state(full, rank)["model"], os.path.join(d, "m.safetensors"), layout="file",
                     format="safetensors")
        result["safetensors"] = None
    except ValueError as e:
        result["safetensors"] = str(e)


def async_check(d: str, rank: int, result: dict, writer: str) -> None:
    """In the background (on a thread, or in the writer process, which gets the pieces and
    the ranges with them): the ranges change in place once the fence returns; the file
    holds the state as of save()."""
    full = synthetic(2)
    state = flat_state(full, rank)
    path = os.path.join(d, f"async-{writer}.pt")
    ck = fp_core.AsyncCheckpointer(policy="snapshot", writer=writer)
    h = ck.save(state, path, layout="file")
    ck.fence()
    with torch.no_grad():
        for v in full.values():
            v.add_(1)
    h.result()
    ck.close()
    dist.barrier()
    result[f"async_{writer}_differ"] = differ({"model": synthetic(2), "step": 3}, torch.load(path, weights_only=True))


def unsupported_check(result: dict) -> None:
    """Where the flat-shard route does not apply, each case with its reason (the caller
    gathers as stock does instead); mixed precision whose dtypes are the originals' does."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return {"v": 1}

        def set_extra_state(self, state) -> None:
            pass

    class OwnState(torch.nn.Linear):  # as torchmetrics' metrics add their states
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "calls"] = torch.tensor(3)

    hooked = torch.nn.Linear(4, 4)
    hooked.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)

    def wrap(net=None, **kw):
        net = net or torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4))
        return FSDP(net, device_id=torch.device("cpu"), use_orig_params=True, **kw)

    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    plain = wrap()
    cases = {
        "supported": (plain, [torch.optim.Adam(plain.parameters())]),
        "fp32": (wrap(mixed_precision=MixedPrecision(torch.float32, torch.float32, torch.float32)), []),
        "bf16": (wrap(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), []),
        "buffers": (wrap(torch.nn.BatchNorm1d(4), mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16)), []),
        "offload": (wrap(cpu_offload=CPUOffload(offload_params=True)), []),
        "no_shard": (wrap(sharding_strategy=ShardingStrategy.NO_SHARD), []),
        "tied": (wrap(tied), []),
        "extra": (wrap(torch.nn.Sequential(Extra(4, 4))), []),
        "own_state": (wrap(torch.nn.Sequential(OwnState(4, 4))), []),
        "hooked": (wrap(torch.nn.Sequential(hooked)), []),
        "foreign": (plain, [torch.optim.Adam([*plain.parameters(), torch.nn.Parameter(torch.ones(2))])]),
        "not_fsdp": (torch.nn.Linear(2, 2), []),
    }
    result["unsupported"] = {k: fsdp1_flat.unsupported(m, opts) for k, (m, opts) in cases.items()}


def main() -> None:
    rank, world, d, scenario = join()
    result: dict = {"rank": rank}
    with reported(d, rank, result):
        if scenario != "all":
            raise ValueError(scenario)
        fsdp1_check(d, True, result)
        fsdp1_check(d, False, result)
        fsdp1_check(d, True, result, torch.optim.Adagrad)  # state made up front, for every parameter
        ranges_check(d, rank, result)
        async_check(d, rank, result, "thread")
        async_check(d, rank, result, "process")
        unsupported_check(result)


if __name__ == "__main__":
    main()
