"""Lightning with ``FastPersistIO(writer="process", resume_from_memory=True)``: a run killed
right after a checkpoint's fence, and its restart (tests/integrations/test_lightning.py).

``python lightning_process_writer.py DIR kill``: fits with ``ModelCheckpoint(save_last=True,
every_n_train_steps=1)``; at the start of step 5 (step 4's checkpoint saved, the plugin's
fence passed) it writes the weights it holds to ``DIR/expected.pt`` with ``torch.save``, the
writer process's pid to ``DIR/writer.pid``, and SIGKILLs itself, leaving the writer process to commit ``last.ckpt``.

``python lightning_process_writer.py DIR resume``: fits again with ``ckpt_path="last"`` and
writes ``DIR/resume.json``: the global step it resumed at, whether the weights equal
``expected.pt``, and whether ``last.ckpt`` was read from its shared-memory image.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as lp  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from fp_core.io import memory_image  # noqa: E402
from fp_integrations.lightning import FastPersistIO  # noqa: E402


class Killer(lp.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 4:
            ckpt = trainer.strategy.checkpoint_io._ckpt
            ckpt.fence()  # what the next optimizer step does first
            with open(os.path.join(self.directory, "writer.pid"), "w") as f:
                f.write(str(ckpt._writer_proc.pid))
            torch.save({k: v.clone() for k, v in pl_module.state_dict().items()},
                       os.path.join(self.directory, "expected.pt"))
            os.kill(os.getpid(), signal.SIGKILL)


class Report(lp.Callback):
    def __init__(self, directory: str, hits: int) -> None:
        self.directory, self.hits = directory, hits

    def on_train_start(self, trainer, pl_module) -> None:
        want = torch.load(os.path.join(self.directory, "expected.pt"), weights_only=True)
        got = pl_module.state_dict()
        with open(os.path.join(self.directory, "resume.json"), "w") as f:
            json.dump({"global_step": trainer.global_step,
                       "same": all(torch.equal(got[k], want[k]) for k in want),
                       "from_memory": memory_image.hits > self.hits}, f)


def main(directory: str, mode: str) -> None:
    torch.manual_seed(0)
    io = FastPersistIO(writer="process", resume_from_memory=True)
    ckpt = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1)
    extra = [Killer(directory)] if mode == "kill" else [Report(directory, memory_image.hits)]
    trainer = lp.Trainer(max_steps=8, accelerator="cpu", devices=1, plugins=[io], callbacks=[ckpt, *extra],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel(), ckpt_path="last" if mode == "resume" else None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
