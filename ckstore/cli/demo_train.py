"""The main job: a small real training run checkpointing into a ckstore store.

A character-level GRU language model learns to write Python, trained on the source of a few
standard-library modules (always present, nothing to download). It commits every few steps with
its real train and validation loss; ``ckstore demo`` then shows the log, checks out the best
checkpoint by validation loss and resumes from it, forks a fine-tune with a frozen embedding and
diffs it against its parent, and applies a retention policy with gc.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["DemoConfig", "CharModel", "load_corpus", "Trainer"]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    steps: int = 240
    commit_every: int = 20
    epoch_every: int = 80
    batch: int = 32
    seq: int = 96
    hidden: int = 192
    embed: int = 64
    lr: float = 3e-3
    seed: int = 0


def load_corpus() -> str:
    import argparse
    import collections
    import json.decoder
    import textwrap

    return "\n".join(inspect.getsource(m) for m in (argparse, collections, json.decoder, textwrap))


class CharModel(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.GRU(embed, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        out: torch.Tensor = self.head(h)
        return out


class Trainer:
    """Model, optimizer, scheduler and data, with state dicts in ckstore's sub-checkpoint shape."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        text = load_corpus()
        chars = sorted(set(text))
        self.vocab = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([self.vocab[c] for c in text], dtype=torch.long)
        cut = int(len(data) * 0.9)
        self.train_data, self.val_data = data[:cut], data[cut:]
        torch.manual_seed(cfg.seed)
        self.model = CharModel(len(chars), cfg.embed, cfg.hidden)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.steps * 2)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0

    def batch(self, data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - self.cfg.seq - 1, (self.cfg.batch,), generator=gen)
        x = torch.stack([data[i : i + self.cfg.seq] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + self.cfg.seq] for i in ix])
        return x, y

    def train_step(self) -> float:
        self.model.train()
        x, y = self.batch(self.train_data, self.gen)
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def val_loss(self, batches: int = 4) -> float:
        self.model.eval()
        gen = torch.Generator().manual_seed(1234)
        losses = []
        for _ in range(batches):
            x, y = self.batch(self.val_data, gen)
            losses.append(float(nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())))
        return sum(losses) / len(losses)

    def state(self) -> dict[str, Any]:
        return {
            "model_states": self.model.state_dict(),
            "optim_states": self.opt.state_dict(),
            "lr_scheduler": self.sched.state_dict(),
            "trainer": {"step": self.step, "data_rng": self.gen.get_state(), "torch_rng": torch.get_rng_state()},
        }

    def load(self, states: dict[str, Any]) -> None:
        self.model.load_state_dict(states["model_states"])
        self.opt.load_state_dict(states["optim_states"])
        self.sched.load_state_dict(states["lr_scheduler"])
        self.step = int(states["trainer"]["step"])
        self.gen.set_state(states["trainer"]["data_rng"])
        torch.set_rng_state(states["trainer"]["torch_rng"])


def train(
    trainer: Trainer,
    steps: int,
    on_commit: Callable[[int, dict[str, float]], None],
    commit_every: int,
    log: Callable[[str], None] = print,
) -> None:
    start = time.perf_counter()
    losses: list[float] = []
    for _ in range(steps):
        losses.append(trainer.train_step())
        if trainer.step % commit_every == 0:
            metrics: dict[str, float] = {
                "train_loss": sum(losses) / len(losses),
                "val_loss": trainer.val_loss(),
                "lr": float(trainer.sched.get_last_lr()[0]),
            }
            losses.clear()
            log(
                f"step {trainer.step:4d}  train_loss {metrics['train_loss']:.3f}  val_loss {metrics['val_loss']:.3f}"
                f"  ({time.perf_counter() - start:.1f}s)"
            )
            on_commit(trainer.step, metrics)
    if not math.isfinite(trainer.val_loss()):
        raise RuntimeError("training diverged")
