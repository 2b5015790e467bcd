"""FastPersistCallback against the real transformers Trainer on CPU (tiny models from configs)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
import warnings
import zipfile
from collections.abc import Iterator

import pytest

import fp_core

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from fp_core.loading.checkpoint_dir import DIR_MANIFEST, read_dir_manifest  # noqa: E402
from fp_core.pipeline.checkpointer import AsyncCheckpointer  # noqa: E402
from fp_integrations._policy import FastPersistWarning  # noqa: E402
from fp_integrations.hf import STAGING_PREFIX, FastPersistCallback, intercept_safetensors_writes  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from process_writer_victim import wait_gone  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/integrations/ -> repo
CKPT_FILES = {"config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
              "trainer_state.json", "training_args.bin"}
FP_CKPT_FILES = CKPT_FILES | {DIR_MANIFEST}  # the callback's checkpoint-N also lists its files


# ------------------------------------------------------------------------------ helpers
class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=8, vocab=64, lm=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)
        self.y = self.x.clone() if lm else torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def tiny_bert(hidden=16, layers=2, vocab=64, dropout=0.1):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * hidden, max_position_embeddings=16,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(cfg)


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16))


def make_args(out, **kw):
    base = dict(output_dir=str(out), max_steps=6, save_steps=2, per_device_train_batch_size=4, use_cpu=True,
                report_to=[], dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, seed=42)
    base.update(kw)
    return TrainingArguments(**base)


def make_trainer(out, fp, model=None, dataset=None, callbacks=(), cb_kwargs=None, trainer_kwargs=None, **kw):
    model = model if model is not None else tiny_bert()
    cbs = list(callbacks)
    fpcb = None
    if fp:
        fpcb = FastPersistCallback(**(cb_kwargs or {}))
        cbs.insert(0, fpcb)
    t = Trainer(model=model, args=make_args(out, **kw), train_dataset=dataset or TokenDataset(), callbacks=cbs,
                **(trainer_kwargs or {}))
    return t, fpcb


def checkpoints(out):
    return sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))


def listing(out):
    """Each checkpoint's files, FastPersist's directory manifest left out (stock has none)."""
    return {c: sorted(n for n in os.listdir(os.path.join(out, c)) if n != DIR_MANIFEST) for c in checkpoints(out)}


def state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def optim_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (i, k)


def trainer_state_core(path_or_state):
    if isinstance(path_or_state, str):
        with open(path_or_state) as f:
            d = json.load(f)
    else:
        d = json.loads(json.dumps(dataclasses.asdict(path_or_state), default=str))
    drop = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")
    d["log_history"] = [{k: v for k, v in e.items() if k not in drop} for e in d["log_history"]]
    for k in ("best_model_checkpoint", "stateful_callbacks", "total_flos"):
        d.pop(k, None)
    return d


def no_staging(out):
    return not [n for n in os.listdir(out) if n.startswith(".fastpersist")]


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


# ------------------------------------------------------------------------------ tests
def test_file_set_and_contents_match_stock(tmp_path):
    stock, _ = make_trainer(tmp_path / "stock", fp=False)
    stock.train()
    t, cb = make_trainer(tmp_path / "fp", fp=True)
    t.train()
    assert cb.active and [r.ok for r in cb.records] == [True, True, True]
    assert listing(tmp_path / "fp") == listing(tmp_path / "stock")
    assert set(listing(tmp_path / "fp")["checkpoint-6"]) == CKPT_FILES
    assert all(set(os.listdir(tmp_path / "fp" / c)) == FP_CKPT_FILES for c in checkpoints(tmp_path / "fp"))
    assert no_staging(tmp_path / "fp")
    for c in checkpoints(tmp_path / "fp"):
        a, b = tmp_path / "stock" / c, tmp_path / "fp" / c
        state_equal(load_file(a / "model.safetensors"), load_file(b / "model.safetensors"))
        with safe_open(b / "model.safetensors", "pt") as f:
            meta = f.metadata()  # stock's, and FastPersist's checksums beside it
            assert {k: v for k, v in meta.items() if not k.startswith("fastpersist.")} == {"format": "pt"}
            assert fp_core.verify(b / "model.safetensors")["checksums"]
        optim_equal(torch.load(a / "optimizer.pt", weights_only=True), torch.load(b / "optimizer.pt", weights_only=True))
        assert torch.load(a / "scheduler.pt", weights_only=True) == torch.load(b / "scheduler.pt", weights_only=True)
        assert trainer_state_core(str(a / "trainer_state.json")) == trainer_state_core(str(b / "trainer_state.json"))
        with open(b / "trainer_state.json") as f:
            st = json.load(f)
        assert "TrainerControl" in st["stateful_callbacks"]
        ra = torch.load(a / "rng_state.pth", weights_only=False)
        rb = torch.load(b / "rng_state.pth", weights_only=False)
        assert torch.equal(ra["cpu"], rb["cpu"])
        # from_pretrained on the checkpoint directory
        m = BertForSequenceClassification.from_pretrained(b)
        state_equal(m.state_dict(), BertForSequenceClassification.from_pretrained(a).state_dict())
    # the model after training equals the last checkpoint
    state_equal(t.model.state_dict(), BertForSequenceClassification.from_pretrained(tmp_path / "fp" / "checkpoint-6").state_dict())


def test_resume_equivalence(tmp_path):
    # 20 steps straight (FastPersist) vs 10 + resume (FastPersist), and stock straight.
    straight, _ = make_trainer(tmp_path / "straight", fp=True, max_steps=20, save_steps=10)
    straight.train()
    stock, _ = make_trainer(tmp_path / "stock", fp=False, max_steps=20, save_steps=10)
    stock.train()
    state_equal(straight.model.state_dict(), stock.model.state_dict())

    first, _ = make_trainer(tmp_path / "resumed", fp=True, max_steps=20, save_steps=10, callbacks=[StopAt(10)])
    first.train()
    assert checkpoints(tmp_path / "resumed") == ["checkpoint-10"]
    # a crashed save left a staging directory behind: resume must ignore it, and it is cleaned
    junk = tmp_path / "resumed" / f"{STAGING_PREFIX}15"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"torn")
    assert get_last_checkpoint(str(tmp_path / "resumed")).endswith("checkpoint-10")

    second, cb = make_trainer(tmp_path / "resumed", fp=True, max_steps=20, save_steps=10)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 20
    state_equal(second.model.state_dict(), straight.model.state_dict())
    optim_equal(second.optimizer.state_dict(), straight.optimizer.state_dict())
    assert second.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()
    a = trainer_state_core(second.state)
    b = trainer_state_core(straight.state)
    assert a == b
    assert no_staging(tmp_path / "resumed")
    # the final checkpoints agree file by file too
    for name in ("model.safetensors",):
        state_equal(load_file(tmp_path / "resumed" / "checkpoint-20" / name),
                    load_file(tmp_path / "straight" / "checkpoint-20" / name))
    optim_equal(torch.load(tmp_path / "resumed" / "checkpoint-20" / "optimizer.pt", weights_only=True),
                torch.load(tmp_path / "straight" / "checkpoint-20" / "optimizer.pt", weights_only=True))


def test_rotation_save_total_limit(tmp_path):
    stock, _ = make_trainer(tmp_path / "stock", fp=False, max_steps=10, save_steps=2, save_total_limit=2)
    stock.train()
    t, cb = make_trainer(tmp_path / "fp", fp=True, max_steps=10, save_steps=2, save_total_limit=2)
    t.train()
    assert checkpoints(tmp_path / "fp") == checkpoints(tmp_path / "stock") == ["checkpoint-8", "checkpoint-10"]
    assert len(cb.records) == 5 and all(r.ok for r in cb.records)
    assert no_staging(tmp_path / "fp")


def test_staged_checkpoints_are_invisible_until_committed(tmp_path):
    seen = []

    class Probe(TrainerCallback):  # runs right after our save returned (on_save)
        def on_save(self, args, state, control, **kw):
            for c in checkpoints(args.output_dir):
                seen.append(set(os.listdir(os.path.join(args.output_dir, c))))
            last = get_last_checkpoint(args.output_dir)
            if last is not None:
                assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(os.listdir(last))

    t, cb = make_trainer(tmp_path / "fp", fp=True, model=tiny_bert(hidden=128, layers=2, vocab=2000),
                         dataset=TokenDataset(vocab=2000), max_steps=6, save_steps=1, callbacks=[Probe()])
    t.train()
    assert seen and all(CKPT_FILES <= s for s in seen)
    assert checkpoints(tmp_path / "fp") == [f"checkpoint-{i}" for i in range(1, 7)]


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_consistent_under_continued_training(tmp_path, policy):
    captured = {}

    class Capture(TrainerCallback):  # the state the checkpoint must hold, cloned at save time
        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            captured[state.global_step] = (
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                 for i, s in optimizer.state_dict()["state"].items()},
            )

    model = tiny_bert(hidden=256, layers=4, vocab=4000)
    t, cb = make_trainer(tmp_path / "fp", fp=True, model=model, dataset=TokenDataset(vocab=4000),
                         max_steps=6, save_steps=1, callbacks=[Capture()], cb_kwargs={"policy": policy},
                         learning_rate=1e-2)
    t.train()
    assert [r.ok for r in cb.records] == [True] * 6
    for step, (msd, osd) in captured.items():
        d = tmp_path / "fp" / f"checkpoint-{step}"
        m = BertForSequenceClassification.from_pretrained(d)
        state_equal(m.state_dict(), msd)
        saved = torch.load(d / "optimizer.pt", weights_only=True)["state"]
        assert saved.keys() == osd.keys()
        for i in osd:
            for k, v in osd[i].items():
                assert torch.equal(saved[i][k], v), (step, i, k)
    # and training really moved on after each save
    assert not torch.equal(captured[1][0]["classifier.weight"], captured[6][0]["classifier.weight"])


def test_tied_weights_gpt2_round_trip(tmp_path):
    ds = TokenDataset(lm=True)
    stock, _ = make_trainer(tmp_path / "stock", fp=False, model=tiny_gpt2(), dataset=ds, max_steps=4)
    stock.train()
    t, cb = make_trainer(tmp_path / "fp", fp=True, model=tiny_gpt2(), dataset=ds, max_steps=4)
    t.train()
    assert listing(tmp_path / "fp") == listing(tmp_path / "stock")
    assert "generation_config.json" in listing(tmp_path / "fp")["checkpoint-4"]
    d = tmp_path / "fp" / "checkpoint-4"
    with safe_open(d / "model.safetensors", "pt") as f, \
            safe_open(tmp_path / "stock" / "checkpoint-4" / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert "lm_head.weight" not in f.keys()
    m = GPT2LMHeadModel.from_pretrained(d)
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    state_equal(m.state_dict(), t.model.state_dict())


def test_sharded_weights_and_index(tmp_path):
    model = tiny_bert(hidden=64, layers=2, vocab=256)
    model.save_pretrained(tmp_path / "stock", max_shard_size="60KB")
    os.makedirs(tmp_path / "fp")
    ck = AsyncCheckpointer()
    handles = []
    with intercept_safetensors_writes(ck, handles):
        model.save_pretrained(tmp_path / "fp", max_shard_size="60KB")
    ck.close()
    assert len(handles) > 1
    assert sorted(os.listdir(tmp_path / "fp")) == sorted(os.listdir(tmp_path / "stock"))
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "fp")
    state_equal(BertForSequenceClassification.from_pretrained(tmp_path / "fp").state_dict(), model.state_dict())


@pytest.mark.parametrize("save_total_limit,save_strategy", [(2, "steps"), (1, "steps"), (None, "best")])
def test_load_best_model_at_end(tmp_path, save_total_limit, save_strategy):
    def run(out, fp):
        scores = iter([0.1, 0.9, 0.3, 0.5])

        def compute_metrics(p):
            return {"score": next(scores)}

        return make_trainer(out, fp=fp, max_steps=8, save_steps=2, eval_steps=2, eval_strategy="steps",
                            save_strategy=save_strategy, load_best_model_at_end=True,
                            metric_for_best_model="score", greater_is_better=True,
                            save_total_limit=save_total_limit, per_device_eval_batch_size=8,
                            trainer_kwargs={"compute_metrics": compute_metrics,
                                            "eval_dataset": TokenDataset(n=8, seed=1)})

    results = {}
    for name, fp in (("stock", False), ("fp", True)):
        t, cb = run(tmp_path / name, fp)
        t.train()
        results[name] = (t, cb)
    (s, _), (f, cb) = results["stock"], results["fp"]
    assert os.path.basename(f.state.best_model_checkpoint) == os.path.basename(s.state.best_model_checkpoint) == "checkpoint-4"
    assert f.state.best_metric == s.state.best_metric == 0.9
    assert checkpoints(tmp_path / "fp") == checkpoints(tmp_path / "stock")
    # the best model was loaded at the end, from a committed checkpoint
    state_equal(f.model.state_dict(), s.model.state_dict())
    best = load_file(tmp_path / "fp" / "checkpoint-4" / "model.safetensors")
    sd = f.model.state_dict()
    for k, v in best.items():
        assert torch.equal(sd[k], v), k
    with open(tmp_path / "fp" / "checkpoint-4" / "trainer_state.json") as fh:
        assert json.load(fh)["best_model_checkpoint"].endswith("checkpoint-4")
    assert no_staging(tmp_path / "fp")


class TiedPlain(torch.nn.Module):
    """A plain nn.Module whose state_dict has two names for one tensor (safetensors refuses)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)
        self.out = torch.nn.Linear(8, 64, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1))
        return {"loss": loss, "logits": logits}


def test_on_error_raise_and_warn(tmp_path):
    ds = TokenDataset(lm=True)
    t, _ = make_trainer(tmp_path / "raise", fp=True, model=TiedPlain(), dataset=ds, max_steps=4)
    with pytest.raises(Exception, match="share memory|shared"):
        t.train()
    t, cb = make_trainer(tmp_path / "warn", fp=True, model=TiedPlain(), dataset=ds, max_steps=4,
                         cb_kwargs={"on_error": "warn"})
    with pytest.warns(UserWarning, match="FastPersist"):
        t.train()
    assert t.state.global_step == 4
    assert [r.ok for r in cb.records] == [False, False]
    assert checkpoints(tmp_path / "warn") == []
    assert no_staging(tmp_path / "warn")


def test_fallback_for_subclass_overriding_save(tmp_path):
    class MyTrainer(Trainer):
        def _save_checkpoint(self, model, trial):
            self.custom_called = True
            return super()._save_checkpoint(model, trial)

    cb = FastPersistCallback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = MyTrainer(model=tiny_bert(), args=make_args(tmp_path / "o", max_steps=2), train_dataset=TokenDataset(),
                      callbacks=[cb])
    assert any("overrides _save_checkpoint" in str(x.message) for x in w)
    assert cb.trainer is t and not cb.active
    t.train()
    assert t.custom_called and checkpoints(tmp_path / "o") == ["checkpoint-2"]


def test_attach_explicitly_and_add_callback(tmp_path):
    t = Trainer(model=tiny_bert(), args=make_args(tmp_path / "o", max_steps=2), train_dataset=TokenDataset())
    cb = FastPersistCallback(trainer=t)
    t.add_callback(cb)
    t.train()
    assert cb.active and [r.ok for r in cb.records] == [True]
    assert set(os.listdir(tmp_path / "o" / "checkpoint-2")) == FP_CKPT_FILES



def test_detach_gives_the_trainer_its_stock_methods_back(tmp_path):
    t = Trainer(model=tiny_bert(), args=make_args(tmp_path / "o", max_steps=2), train_dataset=TokenDataset())
    stock = {n for n in ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "save_model")
             if n not in t.__dict__}
    cb = FastPersistCallback(trainer=t)
    t.add_callback(cb)
    assert {"_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler"} <= set(t.__dict__)
    t.train()
    cb.detach()
    assert not stock & set(t.__dict__)  # the class's own methods again
    assert cb.trainer is None
    t.args.output_dir = str(tmp_path / "stock")
    t.save_model()  # the stock save, no FastPersist manifest
    assert os.path.isfile(tmp_path / "stock" / "model.safetensors")

DIST_SCRIPT = textwrap.dedent("""
    import os, signal, sys, json, time, torch
    import torch.distributed as dist
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {here!r})
    from test_hf import TokenDataset, tiny_bert, make_args, StopAt
    from transformers import Trainer, TrainerCallback
    from fp_integrations.hf import FastPersistCallback
    # At step 4's start, once checkpoint-3's fence has passed on both ranks (its files and
    # the directory's commit in the writers' hands), rank 0 (the rank that saves) is
    # SIGKILLed; torchrun then stops rank 1 (SIGTERM).
    class KillRank0AfterTheFence(TrainerCallback):
        def __init__(self, cb):
            self.cb = cb
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 3:
                self.cb.fence()
                with open(os.path.join(args.output_dir, f"writer{{args.process_index}}.pid"), "w") as f:
                    f.write(str(self.cb.checkpointer._writer_proc.pid))
                dist.barrier()
                if args.process_index == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(120)  # rank 1: until torchrun's SIGTERM (not an error from rank 0's death)
    def killed(out):
        cb = FastPersistCallback(all_ranks_write=True, writer="process")
        t = Trainer(model=tiny_bert(), args=make_args(out, max_steps=6, save_steps=3), train_dataset=TokenDataset(),
                    callbacks=[cb, KillRank0AfterTheFence(cb)])
        t.train()
    def run(out, all_ranks_write):
        def trainer(cbs):
            cb = FastPersistCallback(all_ranks_write=all_ranks_write)
            t = Trainer(model=tiny_bert(), args=make_args(out, max_steps=6, save_steps=3), train_dataset=TokenDataset(),
                        callbacks=[cb] + cbs)
            return t, cb
        t, cb = trainer([StopAt(3)])
        t.train()
        rank = t.args.process_index
        assert cb.active and [r.ok for r in cb.records] == [True], cb.records
        t2, cb2 = trainer([])
        t2.train(resume_from_checkpoint=True)
        assert t2.state.global_step == 6
        opt = [h for h in cb2.records[-1].handles if h.path.endswith("optimizer.pt")]
        res = {{"rank": rank, "world": t.args.world_size, "records": [r.ok for r in cb2.records],
               "files": sorted(os.listdir(os.path.join(out, "checkpoint-6"))),
               "optimizer_writers": [h.result().writers for h in opt]}}
        with open(os.path.join(out, f"result_{{rank}}.json"), "w") as f:
            json.dump(res, f)
    # OUT MODE pairs, one run after the other in this launch (each its own Trainers,
    # callbacks and directory; a launch imports torch and transformers again): MODE is
    # ALL_RANKS_WRITE (0 or 1), or "kill" (last: it ends the launch)
    for i in range(1, len(sys.argv), 2):
        if sys.argv[i + 1] == "kill":
            killed(sys.argv[i])
        else:
            run(sys.argv[i], sys.argv[i + 1] == "1")
""")


@pytest.fixture(scope="module")
def torchrun_outs(tmp_path_factory) -> Iterator[dict]:
    """One torchrun launch (2 CPU processes) runs DIST_SCRIPT for all_ranks_write False, then
    True, then the run whose rank 0 is killed, each into its own directory: {mode: its
    output directory} (mode: all_ranks_write, or "kill")."""
    tmp_path = tmp_path_factory.mktemp("torchrun")
    script = tmp_path / "dist_train.py"
    script.write_text(DIST_SCRIPT.format(repo=REPO, here=os.path.dirname(os.path.abspath(__file__))))
    outs = {False: tmp_path / "out0", True: tmp_path / "out1", "kill": tmp_path / "out-kill"}
    shm = os.path.join("/dev/shm", "fp-pw-" + uuid.uuid4().hex[:8])  # the writer processes' arenas
    os.mkdir(shm)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO, FASTPERSIST_SHM_DIR=shm)
    with socket.socket() as s:  # torchrun's --master_port 0 hangs with the static rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
                             str(outs[False]), "0", str(outs[True]), "1", str(outs["kill"]), "kill"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
        stdout, stderr = proc.communicate()
        pytest.fail("torchrun run timed out:\n" + stdout[-2000:] + stderr[-4000:])
    assert proc.returncode != 0, "rank 0 of the last run was to be killed"
    assert "Signal 9" in stderr or "SIGKILL" in stderr, stdout[-3000:] + stderr[-5000:]
    outs["shm"] = shm
    yield outs
    shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("all_ranks_write", [False, True])
def test_torchrun_two_cpu_processes(torchrun_outs, all_ranks_write):
    out = torchrun_outs[all_ranks_write]
    res = [json.loads((out / f"result_{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["records"] == [True] for r in res)
    files = set(res[0]["files"])
    assert files == (FP_CKPT_FILES - {"rng_state.pth"}) | {"rng_state_0.pth", "rng_state_1.pth"}
    # rank 0 lists the files of both ranks, once both have synced theirs
    assert set(read_dir_manifest(out / "checkpoint-6")["files"]) == files - {DIR_MANIFEST}
    assert checkpoints(out) == ["checkpoint-3", "checkpoint-6"]
    assert set(os.listdir(out / "checkpoint-3")) == files
    assert no_staging(out)
    # optimizer.pt: written by rank 0 alone, or by both ranks, a byte range each
    assert res[0]["optimizer_writers"] == [2 if all_ranks_write else 1]
    assert res[1]["optimizer_writers"] == ([2] if all_ranks_write else [])
    fp_core.verify(out / "checkpoint-6" / "optimizer.pt")


def test_torchrun_rank_0_killed_after_the_fence_still_gets_its_checkpoint(torchrun_outs):
    """DDP with writer="process": checkpoint-3's directory is committed by the ranks'
    writer processes together (rank 0's writer renames it), not by the trainers, so rank
    0's trainer killed right after the fence (and rank 1's, stopped by torchrun) loses nothing."""
    out = torchrun_outs["kill"]
    for r in (0, 1):
        assert wait_gone(int((out / f"writer{r}.pid").read_text()), 60), f"rank {r}'s writer did not finish"
    fp_core.api.wait_for_writers(out)
    assert checkpoints(out) == ["checkpoint-3"] and no_staging(out)
    files = (FP_CKPT_FILES - {"rng_state.pth"}) | {"rng_state_0.pth", "rng_state_1.pth"}
    assert set(os.listdir(out / "checkpoint-3")) == files
    assert set(read_dir_manifest(out / "checkpoint-3")["files"]) == files - {DIR_MANIFEST}
    for name in ("optimizer.pt", "model.safetensors", "scheduler.pt"):
        fp_core.verify(out / "checkpoint-3" / name)
    assert os.listdir(os.path.join(torchrun_outs["shm"], f"fastpersist-{os.geteuid()}")) == []


def _flip_tensor_byte(path):
    """Flip one byte inside the first storage record of a FastPersist file."""
    rec = next(r for r in fp_core.inspect(path) if r.get("kind") == "storage" and r["size"] > 0)
    with open(path, "r+b") as f:
        f.seek(rec["offset"] + rec["size"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    return rec


@pytest.mark.parametrize("damage", ["optimizer byte", "weights truncated"])
def test_resume_refuses_a_corrupt_checkpoint(tmp_path, damage):
    first, _ = make_trainer(tmp_path, fp=True, max_steps=4, save_steps=2)
    first.train()
    ck = tmp_path / "checkpoint-4"
    if damage == "optimizer byte":
        _flip_tensor_byte(ck / "optimizer.pt")
        expect = "optimizer.pt"
    else:
        with open(ck / "model.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(ck / "model.safetensors") - 100)
        expect = "model.safetensors"
    second, _ = make_trainer(tmp_path, fp=True, max_steps=6, save_steps=2)
    with pytest.raises(fp_core.CorruptCheckpointError, match=expect):
        second.train(resume_from_checkpoint=True)
    # the older checkpoint is intact and resumable
    third, _ = make_trainer(tmp_path, fp=True, max_steps=6, save_steps=2)
    third.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert third.state.global_step == 6


def test_checkpointer_options_pass_through():
    """AsyncCheckpointer options given to the callback reach the core."""
    cb = FastPersistCallback(collapse_live_tensors=True, huge_pages=False, queue_depth=4)
    ckpt = cb.checkpointer
    try:
        assert ckpt.collapse_live_tensors and not ckpt.huge_pages
        assert ckpt.options.queue_depth == 4
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------ stock behaviour kept


@pytest.mark.parametrize("where", ["missing", "missing/in/missing/dir", "a file"])
def test_resume_from_a_path_that_is_not_a_checkpoint_raises_stocks_value_error(tmp_path, where):
    """User code catches stock's ValueError("Can't find a valid checkpoint at ...")."""
    target = tmp_path / where
    if where == "a file":
        target.write_text("not a checkpoint")
    for fp in (False, True):
        t, _ = make_trainer(tmp_path / f"o{fp}", fp=fp, max_steps=2)
        with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
            t.train(resume_from_checkpoint=str(target))


def test_resume_from_legacy_format_optimizer_and_scheduler(tmp_path):
    """optimizer.pt / scheduler.pt in torch's legacy (non-zip) format load with stock: not refused."""
    t, _ = make_trainer(tmp_path / "o", fp=True, max_steps=2)
    t.train()
    ck = tmp_path / "o" / "checkpoint-2"
    for name in ("optimizer.pt", "scheduler.pt"):
        obj = torch.load(ck / name, weights_only=False)
        torch.save(obj, ck / name, _use_new_zipfile_serialization=False)
        assert not zipfile.is_zipfile(ck / name)
    # files of another size than the callback listed are refused (test_a_file_missing_...):
    # a directory of legacy files is one another tool wrote, without the callback's manifest
    os.remove(ck / DIR_MANIFEST)
    t2, _ = make_trainer(tmp_path / "o", fp=True, max_steps=4)
    t2.train(resume_from_checkpoint=str(ck))
    assert t2.state.global_step == 4
    with open(ck / "optimizer.pt", "r+b") as f:  # a truncated *zip* is still refused
        f.truncate(0)
        f.write(b"PK\x03\x04" + b"\x00" * 60)
    from fp_core import CorruptCheckpointError

    t3, _ = make_trainer(tmp_path / "o", fp=True, max_steps=4)
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt"):
        t3.train(resume_from_checkpoint=str(ck))


class _ReadsCheckpointOnSave(TrainerCallback):
    """An experiment tracker: reads checkpoint-{step} in on_save, as WandB/MLflow/Neptune do."""

    def __init__(self):
        self.seen = []

    def on_save(self, args, state, control, **kwargs):
        d = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.seen.append(sorted(os.listdir(d)) if os.path.isdir(d) else None)


@pytest.mark.parametrize("wait_on_save", ["auto", False])
def test_on_save_callbacks_find_the_checkpoint_committed(tmp_path, wait_on_save):
    reader = _ReadsCheckpointOnSave()
    t, cb = make_trainer(tmp_path / "o", fp=True, max_steps=4, callbacks=[reader],
                         cb_kwargs={"wait_on_save": wait_on_save})
    t.train()
    if wait_on_save == "auto":
        assert reader.seen == [sorted(FP_CKPT_FILES)] * 2
    assert checkpoints(tmp_path / "o") == ["checkpoint-2", "checkpoint-4"]


def test_saves_stay_asynchronous_without_on_save_readers(tmp_path):
    t, cb = make_trainer(tmp_path / "o", fp=True, max_steps=4)
    assert not cb._must_commit_before_on_save(t)


@pytest.mark.parametrize("method", ["_save_optimizer_and_scheduler", "_save_scaler"])
def test_fallback_for_subclass_overriding_what_fastpersist_writes(tmp_path, method):
    calls = []

    def override(self, output_dir):
        calls.append(output_dir)
        return getattr(Trainer, method)(self, output_dir)

    MyTrainer = type("MyTrainer", (Trainer,), {method: override})
    cb = FastPersistCallback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = MyTrainer(model=tiny_bert(), args=make_args(tmp_path / "o", max_steps=2), train_dataset=TokenDataset(),
                      callbacks=[cb])
    assert any(f"overrides {method}" in str(x.message) for x in w) and not cb.active
    t.train()
    assert checkpoints(tmp_path / "o") == ["checkpoint-2"]
    if method == "_save_optimizer_and_scheduler":
        assert calls


# ------------------------------------------------------------------------------ error policy


def test_keyboard_interrupt_is_never_a_warning(tmp_path):
    t, cb = make_trainer(tmp_path / "o", fp=True, max_steps=2, cb_kwargs={"on_error": "warn"})
    t.train()

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cb._call(interrupted, "fence")
    with pytest.raises(SystemExit):
        cb._call(lambda: sys.exit(3), "wait")


def test_each_failure_is_reported_even_when_an_id_is_reused(tmp_path):
    t, cb = make_trainer(tmp_path / "o", fp=True, max_steps=2, cb_kwargs={"on_error": "warn"})
    ids = set()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(20):  # each freed before the next is made: CPython hands out the same id again
            e = RuntimeError(f"failure {i}")
            ids.add(id(e))
            cb.errors.handle(e, "save")
            cb.errors.handle(e, "save again")  # one failure is reported once
            del e
    assert [str(x.message) for x in w] == [f"FastPersist: save failed, training continues (on_error='warn'): RuntimeError: failure {i}" for i in range(20)]
    assert len(ids) < 20, "no id was reused: the test did not test anything"


def test_failed_fsync_of_a_staged_checkpoint_leaves_no_staging(tmp_path, monkeypatch):
    import fp_integrations.hf_callback as hf_callback

    def no_fsync(path):
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(hf_callback, "fsync_file", no_fsync)  # the inline files (json, rng) fail to sync
    t, cb = make_trainer(tmp_path / "o", fp=True, max_steps=2)
    with pytest.raises(Exception, match="Input/output error"):
        t.train()
    assert checkpoints(tmp_path / "o") == [] and no_staging(tmp_path / "o")


def test_fastpersist_verify_of_the_callbacks_checkpoint_directory(tmp_path):
    """`fastpersist verify checkpoint-N` and fp_core.verify of the directory the callback
    writes: every file checked for what it is (model.safetensors against its checksums, the
    .pt files byte for byte, JSON parses), the Trainer's own torch.save files listed as
    unchecked; a damaged tensor byte of model.safetensors is named, and resume refuses it."""
    from fp_integrations.hf import verify_checkpoint_dir

    t, _ = make_trainer(tmp_path, fp=True, max_steps=2, save_steps=2)
    t.train()
    ck = tmp_path / "checkpoint-2"
    report = fp_core.verify(ck)
    kinds = {os.path.basename(r["path"]): r.get("kind", "torch") for r in report["reports"]}
    assert kinds["model.safetensors"] == "safetensors" and kinds["optimizer.pt"] == "torch"
    assert kinds["trainer_state.json"] == "json" and kinds["config.json"] == "json"
    assert {"rng_state.pth", "training_args.bin"} <= set(report["unchecked"])
    assert verify_checkpoint_dir(str(ck)) == report["files"] >= 5
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "verify", str(ck)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.startswith(f"OK   {ck}: directory"), out
    rows = fp_core.inspect(ck)
    assert any(r["name"].startswith("model.safetensors:") for r in rows)
    weight = next(r for r in rows if r["name"].startswith("model.safetensors:") and r["size"] >= 1024)
    with open(ck / "model.safetensors", "r+b") as f:
        f.seek(weight["offset"] + weight["size"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(fp_core.CorruptCheckpointError, match="refusing to resume") as ei:
        verify_checkpoint_dir(str(ck))
    assert ei.value.path == str(ck / "model.safetensors") and ei.value.tensor == weight["tensor"]
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "verify", str(ck)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 1 and weight["tensor"] in out.stderr, out


def test_a_file_missing_from_the_callbacks_checkpoint_is_found(tmp_path):
    """The callback lists checkpoint-N's files and sizes in a directory manifest, so a file
    lost after the commit is found: optimizer.pt deleted (the Trainer would resume with a
    fresh optimizer) by fp_core.verify, `fastpersist verify` and the resume check;
    trainer_state.json rewritten to another length (JSON carries no checksums of its own).
    A file added after the commit is reported as extra, not as damage."""
    from fp_integrations.hf import verify_checkpoint_dir

    first, _ = make_trainer(tmp_path, fp=True, max_steps=4, save_steps=2)
    first.train()
    ck2, ck4 = tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"
    listed = read_dir_manifest(ck4)
    assert set(listed["files"]) == CKPT_FILES and listed["dirs"] == []
    assert listed["files"]["optimizer.pt"] == os.path.getsize(ck4 / "optimizer.pt")
    report = fp_core.verify(ck4)
    assert report["manifest"] and report["extra"] == []
    (ck4 / "notes.txt").write_text("added by a callback after the commit")
    report = fp_core.verify(ck4)
    assert report["extra"] == ["notes.txt"] and "notes.txt" in report["unchecked"]

    os.remove(ck4 / "optimizer.pt")
    with pytest.raises(fp_core.CorruptCheckpointError,
                       match="missing: optimizer.pt, listed in the directory manifest") as ei:
        fp_core.verify(ck4)
    assert ei.value.path == str(ck4) and ei.value.record == "optimizer.pt"
    # a resume says so, and goes on from the files that are there, as stock does (a
    # checkpoint edited on purpose, e.g. a resharded model, must still resume)
    with pytest.warns(FastPersistWarning, match="missing: optimizer.pt"):
        assert verify_checkpoint_dir(str(ck4)) > 0
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "verify", str(ck4)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 1 and "missing: optimizer.pt" in out.stderr and str(ck4) in out.stderr, out
    second, _ = make_trainer(tmp_path, fp=True, max_steps=6, save_steps=2)
    with pytest.warns(FastPersistWarning, match="missing: optimizer.pt"):
        second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 6

    state = json.loads((ck2 / "trainer_state.json").read_text())
    (ck2 / "trainer_state.json").write_text(json.dumps(state))  # still JSON, another length
    with pytest.raises(fp_core.CorruptCheckpointError, match="listed in the directory manifest") as ei:
        fp_core.verify(ck2)
    assert ei.value.path == str(ck2 / "trainer_state.json")
