"""The HF Trainer with FSDP2 and FULL_STATE_DICT, stock and with FastPersistCallback.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node N THIS DIR PHASES``.
On CPU accelerate would train with DDP: the state is forced to MULTI_GPU after
TrainingArguments made it, as in hf_fsdp2.py (FSDP2 itself runs on the CPU over gloo).

PHASES, comma-separated, each a fresh Trainer on a tiny GPT-2 built from a config, 4 steps,
a checkpoint every 2 steps, each writing DIR/<phase>.json (rank 0): its losses, the files of
its run directory, the callback's records and load stats (rank 0's), the DTensor gathers its saves made:

- ``stock``: the stock Trainer, DIR/stock, then ``save_model(DIR/stock/final)``;
- ``fp``: with FastPersistCallback, DIR/fp, then ``save_model(DIR/fp/final)``;
- ``fp_resume`` / ``stock_resume``: resume from DIR/fp/checkpoint-2 with / without the callback;
- ``stock_resume_stock``: the stock Trainer resumed from DIR/stock/checkpoint-2 (the baseline);
- ``fp_resume_stock``: the callback resumed from DIR/stock/checkpoint-2 (stock's files);
- ``stock_only_model`` / ``fp_only_model``: as ``stock`` / ``fp`` with ``save_only_model=True``;
- ``fail``: with the callback (``on_error="warn"``), the last rank's write of the step-4
  checkpoint's optimizer.bin fails (after its model files are written);
- ``fail_model``: the same, rank 0's write of the step-4 checkpoint's model.safetensors;
- ``fail_pretrained``: the same, rank 0's save_pretrained of the step-4 checkpoint raises.

The world size goes into each phase's file name (``fp_resume.w1.json``) and run directory.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from hf_fsdp2 import DS  # noqa: E402


def trainer(out: str, callback: bool, on_error: str = "raise", only_model: bool = False) -> tuple[object, object]:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from fp_integrations.hf import FastPersistCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1,
        use_cpu=True, fsdp=True, report_to=[], save_strategy="steps", dataloader_num_workers=0,
        disable_tqdm=True, save_only_model=only_model, fsdp_config={"fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT",
                                        "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    _ = args.device  # accelerate's state now exists (MULTI_CPU, gloo) ...
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # ... and now picks FSDP
    cb = FastPersistCallback(on_error=on_error) if callback else None
    tr = Trainer(model=model, args=args, train_dataset=DS(), callbacks=[cb] if cb else [])
    assert tr.is_fsdp_enabled, "FSDP did not engage"
    return tr, cb


def inject_failure(rank: int, name: str) -> object:
    """This rank's write of the step-4 checkpoint's file ``name`` fails (its first file,
    model.safetensors, or its last, optimizer.bin, once the others are written)."""
    from fp_core.parallel.sharded_file import ShardedFileSave

    real = ShardedFileSave._write_share

    def failing(self, *a, **k):
        if ".fastpersist-staging-4" in self.final and self.final.endswith(name):
            raise OSError(f"injected write failure on rank {rank}")
        return real(self, *a, **k)

    ShardedFileSave._write_share = failing
    return lambda: setattr(ShardedFileSave, "_write_share", real)  # undoes it


GATHERS = {"inside_save": 0, "count": 0}


def count_gathers() -> None:
    """Count DTensor gathers (``full_tensor``, ``redistribute``: what the stock full state
    dict does per tensor) made while a checkpoint or ``save_model`` runs."""
    from torch.distributed.tensor import DTensor

    for name in ("full_tensor", "redistribute"):
        real = getattr(DTensor, name)

        def counted(self, *a, _real=real, **k):
            if GATHERS["inside_save"]:
                GATHERS["count"] += 1
            return _real(self, *a, **k)

        setattr(DTensor, name, counted)


def watch_saves(tr: object) -> None:
    """Mark the Trainer's checkpoint save and save_model (stock or the callback's) as saves."""
    for name in ("_save_checkpoint", "save_model"):
        real = getattr(tr, name)

        def watched(*a, _real=real, **k):
            GATHERS["inside_save"] += 1
            try:
                return _real(*a, **k)
            finally:
                GATHERS["inside_save"] -= 1

        setattr(tr, name, watched)


def fail_save_pretrained() -> object:
    """This rank's save_pretrained of the step-4 checkpoint raises (before any file of it)."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def failing(self, save_directory, *a, **k):
        if ".fastpersist-staging-4" in str(save_directory):
            raise RuntimeError("injected save_pretrained failure")
        return real(self, save_directory, *a, **k)

    PreTrainedModel.save_pretrained = failing
    return lambda: setattr(PreTrainedModel, "save_pretrained", real)  # undoes it


def listing(d: str) -> dict:
    return {n: sorted(os.listdir(os.path.join(d, n))) for n in sorted(os.listdir(d))
            if os.path.isdir(os.path.join(d, n))} | {"": sorted(os.listdir(d))}


def main() -> None:
    import torch.distributed as dist

    d, phases = sys.argv[1], sys.argv[2].split(",")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    tag = "" if world == 2 else f".w{world}"
    count_gathers()
    for phase in phases:
        out = os.path.join(d, phase + tag)
        resume = {"fp_resume": "fp", "stock_resume": "fp", "stock_resume_stock": "stock",
                  "fp_resume_stock": "stock"}.get(phase)
        callback = phase in ("fp", "fp_resume", "fp_resume_stock", "fail", "fail_model", "fail_pretrained", "fp_only_model")
        undo = None
        if phase == "fail" and rank == world - 1:
            undo = inject_failure(rank, "optimizer.bin")
        if phase == "fail_model" and rank == 0:
            undo = inject_failure(rank, "model.safetensors")
        if phase == "fail_pretrained" and rank == 0:
            undo = fail_save_pretrained()
        tr, cb = trainer(out, callback, on_error="warn" if phase.startswith("fail") else "raise",
                         only_model=phase.endswith("only_model"))
        if cb is not None:
            assert cb.fallback_reason is None, cb.fallback_reason
        watch_saves(tr)
        GATHERS["count"] = 0
        tr.train(resume_from_checkpoint=None if resume is None else os.path.join(d, resume, "checkpoint-2"))
        if phase in ("stock", "fp"):
            tr.save_model(os.path.join(out, "final"))
        res = {"losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
               "saves": [[r.step, r.ok, r.error] for r in cb.records] if cb else None,
               "gathers": GATHERS["count"], "load_stats": cb.load_stats if cb else None}
        dist.barrier()
        if rank == 0:
            res["listing"] = listing(out)
            with open(os.path.join(d, f"{phase}{tag}.json"), "w") as f:
                json.dump(res, f)
        del tr, cb
        if undo is not None:
            undo()
    # every process group torn down before exit (see hf_fsdp2.py)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
