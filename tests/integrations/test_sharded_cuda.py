"""Sharded checkpoints on a GPU (run by benchmarks/gpu_check.sh; skipped without CUDA):
Lightning's FSDPStrategy(state_dict_type="sharded") refuses the CPU, so its path through
FastPersist (FSDP1 ShardedTensor state -> dcp.save with FastPersistWriter) is checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS, free_port

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_lightning_fsdp_sharded_checkpoints_through_fastpersist(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(HELPERS, "lightning_fsdp_gpu.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert "last.ckpt" in res["listing"] and len(res["listing"]) == 3  # step 2, step 4, last
    assert "meta.pt" in res["files"] and ".fastpersist-dcp.json" in res["files"]
    assert all(n >= 2 for n in res["verified"].values()), res["verified"]  # rank file + meta.pt
    assert res["stats"] == 3
    assert res["restored_equal"] is True


_SNAPSHOT_SCRIPT = r"""
import os, sys, json, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import fp_core, torch.distributed.checkpoint as dcp
from fp_core.parallel.dcp import FastPersistReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
w = distribute_tensor(torch.randn(8192, 4096, device="cuda"), mesh, [Shard(0)])  # 128 MiB
expected = w.full_tensor().cpu()
ckpt = fp_core.AsyncCheckpointer(policy="snapshot")
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
h = ckpt.save({"w": w}, os.path.join(sys.argv[1], "ckpt")); ckpt.fence()
w.to_local().add_(1.0)  # the step after the fence: not in the checkpoint
h.result(); ckpt.close()
peak = torch.cuda.max_memory_allocated() - base
got = {"w": torch.zeros(8192, 4096)}
dcp.load(got, storage_reader=FastPersistReader(os.path.join(sys.argv[1], "ckpt"), verify=True), no_dist=True)
print(json.dumps({"peak_extra_mib": peak / 2**20, "equal": bool(torch.equal(got["w"], expected))}))
dist.destroy_process_group()
"""


def test_a_snapshot_of_device_dtensors_is_written_from_the_host_copy(tmp_path):
    """The snapshot of a DTensor on a CUDA mesh is rebuilt over its host copy without moving
    it back to the GPU (DTensor.from_local would copy 128 MiB onto the device, from the
    writer thread); the checkpoint holds the values at save()."""
    port = free_port()
    repo = os.path.dirname(os.path.dirname(HELPERS))
    p = subprocess.run([sys.executable, "-c", _SNAPSHOT_SCRIPT, str(tmp_path), repo, port],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["equal"] is True
    assert res["peak_extra_mib"] < 64, res


def test_hf_trainer_fsdp2_on_the_gpu_through_fastpersist(tmp_path):
    """The HF Trainer with FSDP2 (SHARDED_STATE_DICT) on the GPU, nothing forced: one process
    (the GPU check has one device), accelerate's layout through FastPersistWriter, resumed
    exactly through the callback and the stock Trainer."""
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", port,
                        os.path.join(HELPERS, "hf_fsdp2.py"), str(tmp_path), "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert "pytorch_model_fsdp_0" in res["files"] and "optimizer_0" in res["files"]
    assert res["verified"] == {"pytorch_model_fsdp_0": 1, "optimizer_0": 1}
    assert res["saves"] == [[2, True], [4, True]]
    assert res["losses_b"] == res["losses_a"] and res["losses_c"] == res["losses_a"]


_ONE_FILE_SCRIPT = r"""
import os, sys, json, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import fp_core
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
g = torch.Generator(device="cuda").manual_seed(0)
full = {"w": torch.randn(8192, 4096, device="cuda", generator=g),          # 128 MiB, fp32
        "e": torch.randn(1000, 77, device="cuda", generator=g).bfloat16(),  # rows not on a block
        "b": torch.randn(4096, device="cuda", generator=g)}
state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                   "e": distribute_tensor(full["e"], mesh, [Shard(0)]),
                   "b": distribute_tensor(full["b"], mesh, [Replicate()])},
         "step": 3}
expected = {k: v.cpu() for k, v in full.items()}
out = {}
d = sys.argv[1]
# synchronous: device shards copied to host through the engine's staging
st = fp_core.save(state, os.path.join(d, "sync.pt"), layout="file")
got = torch.load(os.path.join(d, "sync.pt"), weights_only=True)
out["sync_equal"] = all(torch.equal(got["model"][k], expected[k]) for k in expected) and got["step"] == 3
out["sync_verify"] = fp_core.verify(os.path.join(d, "sync.pt"))["bytes"] == os.path.getsize(os.path.join(d, "sync.pt"))
# asynchronous, snapshot into pinned host memory: the step after the fence is not in it
ckpt = fp_core.AsyncCheckpointer(policy="snapshot")
h = ckpt.save(state, os.path.join(d, "async.pt"), layout="file"); ckpt.fence()
state["model"]["w"].to_local().add_(1.0)
h.result(); ckpt.close()
got = torch.load(os.path.join(d, "async.pt"), weights_only=True)
out["async_equal"] = all(torch.equal(got["model"][k], expected[k]) for k in expected)
# read back into CUDA DTensors, each rank its rows, checked against the checksums
target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)] if k != "b" else [Replicate()])
                    for k, v in full.items()}, "step": 0}
fp_core.load_into(target, os.path.join(d, "async.pt"), verify=True)
out["load_into_equal"] = all(torch.equal(target["model"][k].to_local().cpu(), expected[k]) for k in expected)
out["load_into_device"] = all(t.to_local().is_cuda for t in target["model"].values())
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_one_file_of_device_dtensors_nccl(tmp_path):
    """layout="file" on a CUDA mesh under NCCL: device shards written (synchronously through
    the engine's staging, asynchronously from a snapshot in pinned host memory) into one
    torch.load file, and read back into CUDA DTensors with verify."""
    port = free_port()
    repo = os.path.dirname(os.path.dirname(HELPERS))
    p = subprocess.run([sys.executable, "-c", _ONE_FILE_SCRIPT, str(tmp_path), repo, port],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == {"sync_equal": True, "sync_verify": True, "async_equal": True, "load_into_equal": True,
                   "load_into_device": True}, res
