"""A rank of a layout="file", format="safetensors" test: every rank of a flat DTensor state
(a model's state dict under FSDP2) writes one safetensors file of the full tensors.

Usage: python sharded_file_st_worker.py RANK WORLD PORT DIR SCENARIO (conftest.run_ranks);
each rank reports to DIR/result<RANK>.json, rank 0 to DIR/result.json as well.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import join, reported  # noqa: E402

import fp_core  # noqa: E402
from fp_core import _native  # noqa: E402

META = {"format": "pt", "written_by": "sharded_file_st_worker"}


def flat_state(gen: int = 0) -> dict[str, torch.Tensor]:
    """The full flat state the sharded one stands for, the same in every process: rows
    that divide by neither 2 nor 3, fewer rows than ranks (empty shards), bf16 beside fp32
    (tensors that end mid-block), a 0-dim tensor."""
    g = torch.Generator().manual_seed(99 + gen)
    return {
        "embed.weight": torch.randn(1001, 48, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(37, 64, generator=g),
        "layers.0.b": torch.randn(37, generator=g).to(torch.bfloat16),
        "layers.0.tiny": torch.randn(1, 5, generator=g),
        "layers.1.w": torch.randn(300, 257, generator=g),
        "layers.2.big": torch.randn(1024, 1024, generator=g),  # each rank's rows O_DIRECT (where the fault is)
        "norm.scale": torch.randn(7, generator=g),  # Replicate()
        "temp": torch.tensor(0.25 + gen),  # 0-dim, Replicate()
        "pos": torch.arange(100, dtype=torch.int64) * (gen + 1),  # a plain tensor
        "pos_t": torch.arange(30, dtype=torch.int32).reshape(5, 6).t(),  # a plain non-contiguous view
        "proj_t": torch.randn(12, 41, generator=g).t(),  # each rank's local shard a non-contiguous view
    }


REPLICATED = ("norm.scale", "temp")


def sharded(mesh, full: dict[str, torch.Tensor]) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    out = {k: v if k.startswith("pos") else distribute_tensor(v, mesh, [Replicate() if k in REPLICATED else Shard(0)])
           for k, v in full.items()}
    v = full["proj_t"]
    local = out["proj_t"].to_local()
    out["proj_t"] = DTensor.from_local(local.t().contiguous().t(), mesh, [Shard(0)], run_check=False,
                                       shape=v.shape, stride=torch.empty(v.shape).stride())
    assert not out["proj_t"].to_local().is_contiguous() or local.shape[0] <= 1
    return out


def tiny_llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=211, hidden_size=48, intermediate_size=97, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    torch.manual_seed(7)
    return LlamaForCausalLM(cfg)


def main() -> None:
    rank, world, d, scenario = join()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    result: dict = {"rank": rank}
    path = os.path.join(d, "model.safetensors")
    with reported(d, rank, result):
        if scenario == "flat":
            state = sharded(mesh, flat_state())
            st = fp_core.save(state, path, layout="file", format="safetensors", metadata=META)
            result.update(rank_bytes=st.extra["rank_bytes"], data_bytes=st.extra["data_bytes"], file_size=st.bytes)
        elif scenario in ("hf", "hf_tied"):
            from torch.distributed.fsdp import fully_shard

            model = tiny_llama(tied=scenario == "hf_tied")
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            sd = model.state_dict()
            if scenario == "hf_tied":
                try:  # one DTensor under two names: refused on every rank, nothing created
                    fp_core.save(sd, path, layout="file", format="safetensors", metadata={"format": "pt"})
                except ValueError as e:
                    result["tied_error"] = str(e)
                result["created"] = os.path.exists(path)
                sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # as save_pretrained drops it
            fp_core.save(sd, path, layout="file", format="safetensors", metadata={"format": "pt"})
            if rank == 0:
                model.config.save_pretrained(d)
        elif scenario == "fail":
            fp_core.save(sharded(mesh, flat_state(0)), path, layout="file", format="safetensors", metadata=META)
            if rank == 1:
                _native.inject_fault("write", errno=5)
            fp_core.save(sharded(mesh, flat_state(1)), path, layout="file", format="safetensors", metadata=META)
        elif scenario == "refuse":
            state = sharded(mesh, flat_state())
            for name, bad in (("nested", {"model": state}), ("dtype", {**state, "c": torch.zeros(2, dtype=torch.complex128)})):
                try:
                    fp_core.save(bad, path, layout="file", format="safetensors")
                except (TypeError, ValueError) as e:
                    result[name] = f"{type(e).__name__}: {e}"
            result["created"] = os.path.exists(path)
        else:
            raise ValueError(scenario)


if __name__ == "__main__":
    main()
