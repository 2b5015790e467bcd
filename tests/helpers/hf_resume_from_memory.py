"""The HF Trainer with ``FastPersistCallback(writer="process", resume_from_memory=...)``: a
run killed after a checkpoint, and resumes of that checkpoint
(tests/integrations/test_hf_resume_from_memory.py).

``python hf_resume_from_memory.py kill DIR on|off [sharded]``: trains a tiny BERT with
``save_steps=4``; at the start of step 5, once checkpoint-4's fence has passed (its files
and the directory's commit are in the writer process's hands, nothing is committed yet), it
writes the writer process's pid to ``DIR/writer.pid`` and SIGKILLs itself.
``on``/``off``: ``resume_from_memory``; ``sharded``: the weights in several safetensors
shards and their index, as ``save_pretrained(max_shard_size=...)`` writes them.

``python hf_resume_from_memory.py resume DIR STEP... [DIR STEP...]``: for each step in
order, a new Trainer resumes from ``DIR/checkpoint-4`` (the last directory named before
the step) and trains to step 8 without saving:

* ``stock``: the Trainer without FastPersist (the stock resume, from disk);
* ``fp``: with ``FastPersistCallback(writer="process", resume_from_memory=True)``;
* ``damage``: first a byte of every image is flipped (in its largest record: a tensor
  where the file holds any, else the pickle), then as ``fp``;
* ``remove``: first every image is removed, then as ``fp``;
* ``save``: as ``fp``, saving every 2 steps with the writer process; its report lists what
  is left in the shared-memory directory once ``train()`` has returned.

Each writes ``DIR/<step>.pt``: the state right after the resume (at the first step's
start: weights, optimizer, scheduler, global step, RNG) and at the end, and
``DIR/<step>.json``: image loads (``memory_image.hits``), the callback's
``load_stats["memory"]`` and the warnings FastPersist logged.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "integrations"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_hf import make_trainer, tiny_bert  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import fp_core  # noqa: E402
from fp_core.io import memory_image  # noqa: E402

CKPT = "checkpoint-4"


class Killer(TrainerCallback):
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.cb = None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 4:
            self.cb.fence()  # checkpoint-4's snapshot taken: its writer commits it, directory and all
            with open(os.path.join(self.directory, "writer.pid"), "w") as f:
                f.write(str(self.cb.checkpointer._writer_proc.pid))
            os.kill(os.getpid(), signal.SIGKILL)


def _clone(x):
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


class Capture(TrainerCallback):
    """The trainer's state at the first step's start (everything the resume loaded)."""

    def __init__(self) -> None:
        self.trainer = None
        self.at_resume = None

    def on_step_begin(self, args, state, control, **kw):
        if self.at_resume is None:
            self.at_resume = _state(self.trainer)


def _state(tr) -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    return {"model": _clone(tr.model.state_dict()), "optimizer": _clone(tr.optimizer.state_dict()),
            "scheduler": _clone(tr.lr_scheduler.state_dict()), "global_step": tr.state.global_step,
            "torch_rng": torch.random.get_rng_state(), "python_rng": repr(py),
            "numpy_rng": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]}


def _images(directory: str) -> list[str]:
    """The images of the checkpoint's files (found as a load finds them)."""
    ck = os.path.join(directory, CKPT)
    return [memory_image.find(os.path.join(ck, n)) for n in sorted(os.listdir(ck))
            if memory_image.find(os.path.join(ck, n))]


def _damage(directory: str) -> dict:
    """Flip a byte in the middle of the largest record of every image (the file's layout read
    from the file on disk, which the image is byte for byte)."""
    ck = os.path.join(directory, CKPT)
    done = {}
    for n in sorted(os.listdir(ck)):
        image = memory_image.find(os.path.join(ck, n))
        if image is None:
            continue
        rec = max((r for r in fp_core.inspect(os.path.join(ck, n)) if r.get("size")), key=lambda r: r["size"])
        with open(image, "r+b") as f:
            f.seek(rec["offset"] + rec["size"] // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        done[n] = rec["offset"] + rec["size"] // 2
    return done


def _remove(directory: str) -> list[str]:
    gone = []
    for image in _images(directory):
        os.unlink(memory_image.index_path(image))
        os.unlink(image)
        gone.append(os.path.basename(image))
    return gone


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resume(directory: str, step: str) -> None:
    report: dict = {}
    if step == "damage":
        report["damaged"] = _damage(directory)
    elif step == "remove":
        report["removed"] = _remove(directory)
    cap = Capture()
    fp = step != "stock"
    saving = {"save_steps": 2} if step == "save" else {"save_strategy": "no"}
    t, cb = make_trainer(os.path.join(directory, f"resumed-{step}"), fp=fp, callbacks=[cap], max_steps=8,
                         cb_kwargs={"writer": "process", "resume_from_memory": True} if fp else None, **saving)
    cap.trainer = t
    handler = Warnings()
    logging.getLogger("fastpersist").addHandler(handler)
    hits = memory_image.hits
    try:
        t.train(resume_from_checkpoint=os.path.join(directory, CKPT))
    finally:
        logging.getLogger("fastpersist").removeHandler(handler)
    torch.save({"at_resume": cap.at_resume, "end": _state(t)}, os.path.join(directory, f"{step}.pt"))
    report.update(hits=memory_image.hits - hits, warnings=handler.messages,
                  memory=cb.load_stats.get("memory") if cb is not None else None)
    if step == "save":
        report["left"] = sorted(os.listdir(memory_image.directory(create=False)))
    with open(os.path.join(directory, f"{step}.json"), "w") as f:
        json.dump(report, f)


def main(argv: list[str]) -> None:
    mode, directory = argv[0], argv[1]
    if mode == "kill":
        killer = Killer(directory)
        model = tiny_bert()
        if "sharded" in argv[3:]:
            # the Trainer's save_model calls save_pretrained without a shard size
            model.save_pretrained = functools.partial(type(model).save_pretrained, model, max_shard_size="12KB")
        t, cb = make_trainer(directory, fp=True, model=model, callbacks=[killer], max_steps=8, save_steps=4,
                             cb_kwargs={"writer": "process", "resume_from_memory": argv[2] == "on"})
        killer.cb = cb
        t.train()
        raise SystemExit("not killed")
    for arg in argv[2:]:
        if os.sep in arg:
            directory = arg
        else:
            resume(directory, arg)


if __name__ == "__main__":
    main(sys.argv[1:])
