"""Supplementary checks next to transformers' own Trainer tests (NOT upstream code).

``run_transformers.sh`` copies this file to ``tests/trainer/test_fastpersist_supplementary.py``
in the transformers test tree, so it uses the same helpers (``trainer_test_utils``) and runs in
both passes: stock and with ``transformers_conftest`` injecting ``FastPersistCallback``. Every
test here passes on a stock 5.24.0 Trainer; a failure in the injected pass is a FastPersist
incompatibility.

* ``test_resume_from_missing_checkpoint_*``: the stock error type and message for a
  ``resume_from_checkpoint`` path that does not exist.
* ``test_resume_from_legacy_format_optimizer_and_scheduler``: checkpoints whose
  ``optimizer.pt`` / ``scheduler.pt`` were written by ``torch.save(...,
  _use_new_zipfile_serialization=False)`` (older code, other tools) still resume.
* ``test_on_save_sees_committed_checkpoint``: when ``on_save`` fires, ``checkpoint-N`` exists
  and is complete -- what WandB/MLflow/Neptune/ClearML/Flyte/DVCLive artifact logging relies on.
* ``test_subclass_save_optimizer_and_scheduler_override_is_honoured``: a Trainer subclass that
  overrides ``_save_optimizer_and_scheduler`` (to add a file) still gets it called.
* ``test_resume_from_stock_checkpoint`` / ``test_stock_resumes_fastpersist_checkpoint``: a
  checkpoint written by one side resumes on the other, same final weights and state.
"""

import dataclasses
import os

import torch
from transformers import Trainer, TrainerCallback
from transformers.testing_utils import TestCasePlus, require_torch

from .trainer_test_utils import (
    RegressionDataset,
    RegressionModelConfig,
    RegressionPreTrainedModel,
    RegressionTrainingArguments,
    TrainerIntegrationCommon,
    get_regression_trainer,
)


def _fp_callbacks(trainer):
    return [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "FastPersistCallback"]


@require_torch
class FastPersistSupplementaryTest(TestCasePlus, TrainerIntegrationCommon):
    def _train(self, tmp_dir, **kw):
        kwargs = {"output_dir": tmp_dir, "train_len": 128, "save_steps": 5, "learning_rate": 0.1, **kw}
        trainer = get_regression_trainer(**kwargs)
        trainer.train()
        return trainer, kwargs

    def test_resume_from_missing_checkpoint_raises_value_error(self):
        tmp_dir = self.get_auto_remove_tmp_dir()
        trainer = get_regression_trainer(output_dir=tmp_dir)
        missing = os.path.join(tmp_dir, "checkpoint-15-bogus")
        with self.assertRaises(ValueError) as context:
            trainer.train(resume_from_checkpoint=missing)
        self.assertIn(f"Can't find a valid checkpoint at {missing}", str(context.exception))

    def test_resume_from_missing_checkpoint_in_missing_dir(self):
        tmp_dir = self.get_auto_remove_tmp_dir()
        trainer = get_regression_trainer(output_dir=tmp_dir)
        missing = os.path.join(tmp_dir, "no-such-dir", "checkpoint-5")
        with self.assertRaises(ValueError) as context:
            trainer.train(resume_from_checkpoint=missing)
        self.assertIn("Can't find a valid checkpoint at", str(context.exception))

    def test_resume_from_legacy_format_optimizer_and_scheduler(self):
        tmp_dir = self.get_auto_remove_tmp_dir()
        trainer, kwargs = self._train(tmp_dir)
        (a, b) = trainer.model.a.item(), trainer.model.b.item()
        state = dataclasses.asdict(trainer.state)

        checkpoint = os.path.join(tmp_dir, "checkpoint-5")
        for name in ("optimizer.pt", "scheduler.pt"):
            path = os.path.join(checkpoint, name)
            obj = torch.load(path, weights_only=True)
            torch.save(obj, path, _use_new_zipfile_serialization=False)

        trainer = get_regression_trainer(**kwargs)
        trainer.train(resume_from_checkpoint=checkpoint)
        self.assertEqual(a, trainer.model.a.item())
        self.assertEqual(b, trainer.model.b.item())
        self.check_trainer_state_are_the_same(state, dataclasses.asdict(trainer.state))

    def test_resume_from_stock_checkpoint(self):
        """A checkpoint written by the stock save resumes with the injected callback (and stock)."""
        tmp_dir = self.get_auto_remove_tmp_dir()
        kwargs = {"output_dir": tmp_dir, "train_len": 128, "save_steps": 5, "learning_rate": 0.1}
        trainer = get_regression_trainer(**kwargs)
        for cb in _fp_callbacks(trainer):  # write this run's checkpoints with the stock save
            cb.detach()
        trainer.train()
        (a, b) = trainer.model.a.item(), trainer.model.b.item()
        state = dataclasses.asdict(trainer.state)

        trainer = get_regression_trainer(**kwargs)
        trainer.train(resume_from_checkpoint=os.path.join(tmp_dir, "checkpoint-5"))
        self.assertEqual(a, trainer.model.a.item())
        self.assertEqual(b, trainer.model.b.item())
        self.check_trainer_state_are_the_same(state, dataclasses.asdict(trainer.state))

    def test_stock_resumes_fastpersist_checkpoint(self):
        """A checkpoint written with the injected callback (stock when not injected) resumes on
        a plain Trainer."""
        tmp_dir = self.get_auto_remove_tmp_dir()
        trainer, kwargs = self._train(tmp_dir)
        (a, b) = trainer.model.a.item(), trainer.model.b.item()
        state = dataclasses.asdict(trainer.state)

        trainer = get_regression_trainer(**kwargs)
        for cb in _fp_callbacks(trainer):
            cb.detach()
        trainer.train(resume_from_checkpoint=os.path.join(tmp_dir, "checkpoint-5"))
        self.assertEqual(a, trainer.model.a.item())
        self.assertEqual(b, trainer.model.b.item())
        self.check_trainer_state_are_the_same(state, dataclasses.asdict(trainer.state))

    def test_on_save_sees_committed_checkpoint(self):
        seen = []

        class CheckOnSave(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
                names = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else None
                seen.append((state.global_step, names))

        tmp_dir = self.get_auto_remove_tmp_dir()
        trainer = get_regression_trainer(output_dir=tmp_dir, save_steps=5, max_steps=10)
        trainer.add_callback(CheckOnSave())
        trainer.train()
        self.assertEqual([step for step, _ in seen], [5, 10])
        for step, names in seen:
            self.assertIsNotNone(names, f"checkpoint-{step} did not exist when on_save ran")
            for f in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
                self.assertIn(f, names, f"checkpoint-{step}/{f} missing when on_save ran")

    def test_subclass_save_optimizer_and_scheduler_override_is_honoured(self):
        class ExtraStateTrainer(Trainer):
            def _save_optimizer_and_scheduler(self, output_dir):
                super()._save_optimizer_and_scheduler(output_dir)
                torch.save({"extra": torch.ones(2)}, os.path.join(output_dir, "extra_state.pt"))

        tmp_dir = self.get_auto_remove_tmp_dir()
        args = RegressionTrainingArguments(tmp_dir, save_steps=5, max_steps=5)
        trainer = ExtraStateTrainer(
            RegressionPreTrainedModel(RegressionModelConfig()), args, train_dataset=RegressionDataset()
        )
        trainer.train()
        ckpt = os.path.join(tmp_dir, "checkpoint-5")
        self.assertTrue(os.path.isfile(os.path.join(ckpt, "optimizer.pt")))
        self.assertTrue(os.path.isfile(os.path.join(ckpt, "extra_state.pt")), sorted(os.listdir(ckpt)))
