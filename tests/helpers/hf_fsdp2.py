"""The HF Trainer with FSDP2 (SHARDED_STATE_DICT) on 2 CPU processes, with FastPersistCallback.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node 2 THIS DIR [cpu|cuda]``.

accelerate enables FSDP only for GPU-like distributed types: on CPU it silently trains
with DDP. So on ``cpu`` (default) this script forces its state to MULTI_GPU after
TrainingArguments made it (gloo stays the backend; FSDP2 itself runs on the CPU); on
``cuda`` (the GPU check) nothing is forced.

Phases (each a fresh Trainer, tiny GPT-2 built from a config):
A. 4 steps with FastPersistCallback, a checkpoint every 2 steps;
B. resume from A's checkpoint-2 with FastPersistCallback, to step 4;
C. resume from A's checkpoint-2 with the stock Trainer (no callback), to step 4.
Rank 0 writes DIR/result.json: A's checkpoint files, what verify says, and the losses.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


class DS(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 128, (16,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def run(out: str, callback: bool, resume: str | None = None, device: str = "cpu") -> tuple[list[float], object]:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from fp_integrations.hf import FastPersistCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1,
        use_cpu=device == "cpu", fsdp="full_shard", report_to=[], save_strategy="steps", dataloader_num_workers=0,
        disable_tqdm=True, fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                        "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    if device == "cpu":
        _ = args.device  # accelerate's state now exists (MULTI_CPU, gloo) ...
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # ... and now picks FSDP
    cbs = [FastPersistCallback()] if callback else []
    tr = Trainer(model=model, args=args, train_dataset=DS(), callbacks=cbs)
    assert tr.is_fsdp_enabled, "FSDP did not engage"
    tr.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in tr.state.log_history if "loss" in h], (cbs[0] if cbs else None)


def main() -> None:
    import fp_core

    d = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    rank = int(os.environ.get("RANK", "0"))
    losses_a, cb = run(os.path.join(d, "a"), callback=True, device=device)
    ckpt2 = os.path.join(d, "a", "checkpoint-2")
    assert cb.fallback_reason is None, cb.fallback_reason
    saves = [(r.step, r.ok) for r in cb.records]
    losses_b, _ = run(os.path.join(d, "b"), callback=True, resume=ckpt2, device=device)
    losses_c, _ = run(os.path.join(d, "c"), callback=False, resume=ckpt2, device=device)
    if rank == 0:
        verified = {}
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            try:
                verified[name] = fp_core.verify(os.path.join(ckpt2, name))["files"]
            except Exception as e:  # noqa: BLE001 - reported to the test
                verified[name] = f"{type(e).__name__}: {e}"
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump({"files": sorted(os.listdir(ckpt2)), "model_files": sorted(os.listdir(
                os.path.join(ckpt2, "pytorch_model_fsdp_0"))), "checkpoints": sorted(
                n for n in os.listdir(os.path.join(d, "a")) if not n.startswith(".")), "saves": saves,
                "verified": verified, "losses_a": losses_a, "losses_b": losses_b, "losses_c": losses_c}, f)
    # Every process group torn down before exit: left to the interpreter's exit, gloo's
    # destructors can race the other rank's and abort ("terminate called without an active
    # exception", seen once in 5 runs under CI).
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
