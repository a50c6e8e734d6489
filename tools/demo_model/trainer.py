"""The training loop: AdamW, linear warmup then cosine decay (or warmup-stable-decay), a copy phase and an
optional unlikelihood stage (:mod:`tools.demo_model.unlikelihood`), seeded batches, resumable checkpoints.

Reproducible: the model is initialised under ``torch.manual_seed(config.seed)``, batch ``i`` depends
on ``(seed, i)`` only (:func:`tools.demo_model.data.batch_at`: the data position is the step), the rate
and row mix of step ``i`` on the config alone, there is no dropout, and a checkpoint holds the model, the
optimizer state (AdamW's moments and step counts), the step and the config, so a resumed run continues
exactly where an uninterrupted one would be (same thread count and machine: float reductions are not
reordered). A checkpoint also resumes under a config with another schedule (``steps``,
``copy_phase_steps``, ``decay_steps``...) when every step it has done would have been the same step under
that config (:func:`same_steps_until`): a ``wsd`` run's constant part extends, or branches into a
cooldown, without redoing anything.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from tools.demo_model.config import BOOKKEEPING, SCHEDULE, DemoConfig
from tools.demo_model.data import batch_at, val_windows
from tools.demo_model.tokenizer import FIRST_ORDINARY_ID
from tools.demo_model.unlikelihood import continuations_at, unlikelihood_loss

CHECKPOINT = "last.pt"


def learning_rate(config: DemoConfig, step: int) -> float:
    if step >= config.unlikelihood_start:  # the unlikelihood stage
        return config.ul_lr
    if step >= config.steps:  # the copy phase
        return config.copy_phase_lr
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    if config.schedule == "wsd":
        cooldown = step - (config.steps - config.decay_steps)
        if cooldown < 0:
            return config.lr
        return config.min_lr + (config.lr - config.min_lr) * (1 - math.sqrt(cooldown / config.decay_steps))
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def new_model(config: DemoConfig) -> Any:  # -> DemoModel
    from tools.demo_model.model import DemoModel

    return DemoModel(config)


def _optimizer(model: Any, config: DemoConfig) -> Any:
    import torch

    trained = [p for p in model.parameters() if p.requires_grad]  # the head alone when head_only
    decay = [p for p in trained if p.ndim >= 2]
    rest = [p for p in trained if p.ndim < 2]  # norms, A_log, dt_bias
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def token_losses(model: Any, windows: np.ndarray) -> Any:
    """Per-token cross-entropy (nats) of ``windows[:, 1:]`` given the preceding tokens (a transformers
    causal LM)."""
    import torch
    import torch.nn.functional as F

    ids = torch.from_numpy(windows)
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(
        ids.shape[0], -1
    )


def evaluate(model: Any, stream: np.ndarray, seq_len: int, limit: int | None, batch: int = 4) -> float:
    """Mean validation loss (nats per token) of a transformers causal LM over the first ``limit``
    windows (all when None)."""
    import torch

    windows = val_windows(stream, seq_len, limit)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            losses = token_losses(model, windows[i : i + batch])
            total += float(losses.sum())
            count += losses.numel()
    model.train()
    return total / count


def evaluate_head(
    model: Any, stream: np.ndarray, seq_len: int, limit: int | None, batch: int = 4
) -> dict[str, float]:
    """The MTP head's validation loss and its teacher-forced agreement with the model's greedy token after
    next (:func:`tools.demo_model.model.head_agreement`) over the first ``limit`` windows."""
    import torch

    from tools.demo_model.model import head_agreement

    windows = val_windows(stream, seq_len, limit)
    model.eval()
    total, count, agree, correct = 0.0, 0, 0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            chunk = torch.from_numpy(windows[i : i + batch])
            _, losses = model(chunk)
            total += float(losses.sum())
            n, a, c = head_agreement(model.lm, model.mtp, chunk)
            count, agree, correct = count + n, agree + a, correct + c
    model.train()
    return {"val_mtp_loss": total / count, "val_mtp_agree": agree / count, "val_mtp_correct": correct / count}


def train(
    config: DemoConfig,
    train_ids: np.ndarray,
    val_ids: np.ndarray,
    work: Path,
    log: Any = print,
    until: int | None = None,
) -> Any:
    """Train (or resume) to ``config.total_steps`` (the main schedule, then the copy phase), or only to step
    ``until`` when it comes first (checkpointed there, to resume later); return the model. Logs JSON lines
    to ``work/train_log.jsonl``."""
    import torch

    from tools.demo_model.gdn import fast_gated_delta_rule

    torch.set_num_threads(config.threads)
    work.mkdir(parents=True, exist_ok=True)
    if config.head_only and not config.init_from:
        raise ValueError("head_only trains a head for an existing model: give init_from (--init-from)")
    model = new_model(config)
    if config.init_from and not (work / CHECKPOINT).is_file():
        from tools.demo_model.warmstart import init_from_export

        info = init_from_export(model, config, Path(config.init_from), train_ids)
        if config.head_only and info["pruned_channels"]:
            raise ValueError(
                f"head_only keeps the model of {config.init_from} as it is: set intermediate to its MLP "
                f"width ({config.intermediate + info['pruned_channels']})"
            )
        log(f"train: starting from {config.init_from} ({info})")
    opt = _optimizer(model, config)
    start = _resume(model, opt, config, work / CHECKPOINT, log)
    end = config.total_steps if until is None else min(until, config.total_steps)
    save = lambda done: _save(model, opt, config, done, work)  # noqa: E731
    if config.head_only:  # the frozen decoder runs once, over the cached rows
        from tools.demo_model.headcache import caches, train_head

        cached = caches(model.lm, config, train_ids, val_ids, work, log)
        train_head(model, opt, config, cached, range(start, end), work, learning_rate, save, log)
        model.eval()
        return model
    record = (work / "train_log.jsonl").open("a")
    model.train()
    t0, tokens = time.time(), 0
    with fast_gated_delta_rule():
        for step in range(start, end):
            for group in opt.param_groups:
                group["lr"] = learning_rate(config, step)
            window_share, random_share, quote_share = config.row_shares(step)
            batch = batch_at(
                train_ids,
                step,
                config.batch,
                config.seq_len,
                config.seed,
                window_share,
                random_share,
                (FIRST_ORDINARY_ID, config.vocab_size),
                quote_share,
                config.quote_span,
                config.quote_gap,
            )
            main, head = model(torch.from_numpy(batch))
            if config.head_only:
                loss = head.mean()
            elif head is None:
                loss = main.mean()
            else:
                loss = main.mean() + config.mtp_weight_at(step) * head.mean()
            if config.unlikelihood_at(step) is not None:
                repeats = continuations_at(model.lm, train_ids, step, config)
                penalty = unlikelihood_loss(model.lm, repeats)
                loss = loss + config.ul_weight * penalty
            loss.backward()
            trained = (p for p in model.parameters() if p.requires_grad)
            norm = torch.nn.utils.clip_grad_norm_(trained, config.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += config.batch * config.seq_len
            done = step + 1
            entry: dict[str, Any] = {"step": done, "loss": round(main.mean().item(), 4)}
            if head is not None:
                entry["mtp_loss"] = round(head.mean().item(), 4)
            if config.unlikelihood_at(step) is not None:  # the share of generated tokens that repeat
                entry["ul_loss"] = round(penalty.item(), 4)
                entry["ul_marked"] = round(float(repeats.marks.sum() / repeats.scored.sum()), 4)
            if done % 10 == 0 or done == config.total_steps:
                elapsed = time.time() - t0
                entry.update(lr=round(learning_rate(config, step), 6), grad_norm=round(norm.item(), 3))
                entry.update(elapsed_s=round(elapsed, 1), tokens_per_s=round(tokens / elapsed))
            if done % config.eval_every == 0 or done in (
                config.steps,
                config.unlikelihood_start,
                config.total_steps,
            ):
                entry["val_loss"] = round(evaluate(model.lm, val_ids, config.seq_len, config.eval_windows), 4)
                if model.mtp is not None:
                    head_eval = evaluate_head(model, val_ids, config.seq_len, config.eval_windows)
                    entry.update({k: round(v, 4) for k, v in head_eval.items()})
                save(done)
            elif done % config.checkpoint_every == 0 or done == end:
                save(done)
            record.write(json.dumps(entry) + "\n")
            record.flush()
            if "lr" in entry or "val_loss" in entry:
                log(" ".join(f"{k}={v}" for k, v in entry.items()))
    record.close()
    model.eval()
    return model


def _save(model: Any, opt: Any, config: DemoConfig, step: int, work: Path) -> None:
    """Write ``work/last.pt`` atomically (a copy taken while training runs is whole), and a kept copy
    ``work/step-NNNNNNN.pt`` at multiples of ``keep_every``."""
    import torch

    path = work / CHECKPOINT
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "config": config.to_dict()}
    torch.save(state, tmp)
    tmp.replace(path)
    if config.keep_every and step % config.keep_every == 0:
        kept = work / f"step-{step:07d}.pt"
        kept.unlink(missing_ok=True)
        kept.hardlink_to(path)


def same_steps_until(written: DemoConfig, wanted: DemoConfig, step: int) -> bool:
    """Whether steps ``0 .. step - 1`` of ``written`` are those of ``wanted``: the same settings (but for
    the schedule's and the bookkeeping fields) and, at every one of those steps, the same learning rate,
    row mix, MTP weight and unlikelihood settings. A checkpoint of ``written`` at ``step`` then resumes as
    ``wanted``."""
    free = (*SCHEDULE, *BOOKKEEPING)
    a = {k: v for k, v in written.to_dict().items() if k not in free}
    b = {k: v for k, v in wanted.to_dict().items() if k not in free}
    if a != b or step > wanted.total_steps:
        return False
    return all(
        learning_rate(written, s) == learning_rate(wanted, s)
        and written.row_shares(s) == wanted.row_shares(s)
        and written.mtp_weight_at(s) == wanted.mtp_weight_at(s)
        and written.unlikelihood_at(s) == wanted.unlikelihood_at(s)
        for s in range(step)
    )


def _resume(model: Any, opt: Any, config: DemoConfig, path: Path, log: Any) -> int:
    import torch

    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=False)
    if not same_steps_until(DemoConfig(**state["config"]), config, state["step"]):
        raise RuntimeError(
            f"{path} (step {state['step']}) was written with other settings, or a schedule that differs "
            "before that step; delete it or train with those settings"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    log(f"train: resuming from step {state['step']} ({path})")
    return int(state["step"])
