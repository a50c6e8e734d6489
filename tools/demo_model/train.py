"""Rebuild the demo model end to end: ``python -m tools.demo_model.train [--out DIR] [--install]``.

Stages, each writing under ``--out`` (default ``./demo-model``); ``--dense`` trains the same geometry
with every layer full attention (a dense model, for benchmarks; not installable as the default):

1. ``data/`` + ``tokenizer/``: the standard library corpus and its BPE (:mod:`tools.demo_model.data`);
2. ``train/``: training on the CPU with checkpoints every 50 steps (``checkpoint_every``); rerunning the
   same command, or ``--resume DIR``, resumes (:mod:`.trainer`); ``--until N`` stops after step N;
   ``--unlikelihood-steps N`` adds the anti-repetition stage (:mod:`.unlikelihood`) after the copy phase,
   e.g. on a finished run's checkpoint: ``--resume RUN --out DIR --unlikelihood-steps 200``;
3. ``hf/``: the ``Qwen3_5ForConditionalGeneration`` checkpoint; ``fp32/`` and ``int4/``: the
   onnxruntime-genai builder's exports (:mod:`.export`);
4. with ``--install``: ``fp32/`` (``export.BUNDLED_EXPORT``) replaces ``src/onnxgen/data/default_model/``.

``metrics.json`` records the settings, the corpus digest, the final validation loss and timings.
Needs torch, transformers and onnxruntime-genai (``pip install -e .[external]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.demo_model.config import DemoConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.demo_model.train", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, help="work directory (default ./demo-model, or the run given to --resume)"
    )
    p.add_argument("--install", action="store_true", help="install the fp32 export as the bundled default")
    p.add_argument(
        "--resume",
        type=Path,
        metavar="PATH",
        help="continue a run: its directory (its train/last.pt) or one of its checkpoints (train/step-N.pt), "
        "with the settings saved in it (flags given here change them, e.g. --steps to extend a wsd run or "
        "branch off its cooldown); with another --out the checkpoint is copied there and the run branches",
    )
    p.add_argument(
        "--until",
        type=int,
        metavar="STEP",
        help="stop after this training step (checkpointed; resume later) and skip the later stages",
    )
    p.add_argument("--steps", type=int, help=f"training steps (default {DemoConfig.steps})")
    p.add_argument("--seed", type=int, help=f"seed (default {DemoConfig.seed})")
    p.add_argument("--threads", type=int, help=f"torch threads (default {DemoConfig.threads})")
    p.add_argument(
        "--init-from",
        help="start from this fp32 export of an earlier demo model (e.g. a copy of the bundled folder)",
    )
    p.add_argument(
        "--copy-phase-steps",
        type=int,
        help=f"steps of the copy phase after --steps (default {DemoConfig.copy_phase_steps})",
    )
    p.add_argument(
        "--unlikelihood-steps",
        type=int,
        help="steps of the unlikelihood stage after the copy phase, which penalizes the repeats of the "
        "model's own greedy continuations (default 0: none; its settings are the ul_* fields of --set)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override any DemoConfig field (repeatable), e.g. --set mtp_weight=0 --set lr=0.002",
    )
    p.add_argument(
        "--dense",
        action="store_true",
        help="every layer full attention: a dense model (no recurrent state) for dense-export benchmarks",
    )
    return p


def config_from_args(args: argparse.Namespace, base: DemoConfig | None = None) -> DemoConfig:
    """``base`` (the defaults when None) with the settings given on the command line."""
    keys = ("steps", "seed", "threads", "copy_phase_steps", "unlikelihood_steps", "init_from")
    given: dict[str, Any] = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.dense:
        given["dense"] = True
    if "init_from" in given:
        given["init_from"] = str(Path(given["init_from"]).resolve())
    fields = {f.name: f.type for f in dataclasses.fields(DemoConfig)}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        kind = {"bool": lambda v: v.lower() in ("1", "true", "yes"), "int": int, "float": float, "str": str}[
            fields[name]
        ]
        try:
            given[name] = kind(value)
        except ValueError:
            raise SystemExit(f"--set {item!r}: {value!r} is not a {fields[name]}") from None
    try:
        return dataclasses.replace(base or DemoConfig(), **given)
    except ValueError as e:
        raise SystemExit(f"invalid settings: {e}") from None


def resume_point(path: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint) of ``--resume PATH``: a run directory or a ``.pt`` in its ``train/``."""
    from tools.demo_model.trainer import CHECKPOINT

    if path.is_dir():
        checkpoint = path / "train" / CHECKPOINT
        if not checkpoint.is_file():
            raise SystemExit(
                f"--resume {path}: no checkpoint {checkpoint}; give a run directory of this tool"
            )
        return path, checkpoint
    if path.suffix == ".pt" and path.is_file() and path.parent.name == "train":
        return path.parent.parent, path
    raise SystemExit(f"--resume {path}: expected a run directory or a train/*.pt checkpoint in one")


def saved_config(checkpoint: Path) -> tuple[DemoConfig, int]:
    """The settings a checkpoint was written with, and its step."""
    import torch

    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    return DemoConfig(**state["config"]), int(state["step"])


def branch(source: Path, checkpoint: Path, out: Path) -> None:
    """Start run directory ``out`` from ``checkpoint`` of run ``source``: the checkpoint becomes its
    ``train/last.pt`` (the data and tokenizer are copied too; the data stage checks them, and so is a
    head-only run's decoder-state cache, which is keyed by the decoder and its rows and rebuilt where
    those differ)."""
    import shutil

    from tools.demo_model.headcache import CACHE_DIR
    from tools.demo_model.trainer import CHECKPOINT

    target = out / "train" / CHECKPOINT
    if target.exists():
        raise SystemExit(f"{out} already holds a run: resume it with --resume {out}, or pick another --out")
    target.parent.mkdir(parents=True)
    shutil.copyfile(checkpoint, target)
    for part in ("data", "tokenizer", f"train/{CACHE_DIR}"):
        if (source / part).is_dir() and not (out / part).exists():
            shutil.copytree(source / part, out / part)


def run(
    config: DemoConfig, out: Path, install: bool = False, log: Any = print, until: int | None = None
) -> dict[str, Any] | None:
    """All stages; with ``until`` before the last step, training only, to that step (returns None)."""
    # import everything first: a long run must not depend on the source tree staying importable
    from onnxgen.testing.hf import export_with_genai_builder  # noqa: F401
    from tools.demo_model.data import prepare
    from tools.demo_model.export import (
        BUNDLED_EXPORT,
        directory_size,
        export,
        install_default,
        reuse_export,
        save_hf_checkpoint,
    )
    from tools.demo_model.gdn import fast_gated_delta_rule
    from tools.demo_model.trainer import evaluate, train

    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    streams = prepare(out, config, log)
    t_train = time.time()
    model = train(config, streams.train, streams.val, out / "train", log, until)
    train_s = time.time() - t_train
    if until is not None and until < config.total_steps:
        log(f"stopped after step {until} of {config.total_steps}: resume with --resume {out}")
        return None
    if config.head_only:  # the decoder is init_from's, unchanged: its held-out loss is that export's
        val_loss = float("nan")
    else:
        with fast_gated_delta_rule():  # the training's own Gated DeltaNet kernels: same loss, less time
            val_loss = evaluate(model.lm, streams.val, config.seq_len, None)
    hf_dir = save_hf_checkpoint(model, config, streams.tokenizer_dir, out / "hf")
    if config.head_only:  # the decoder is the one training started from
        sizes = {"fp32": directory_size(reuse_export(Path(config.init_from), hf_dir, out / "fp32"))}
    else:
        sizes = {p: directory_size(export(hf_dir, out / p, p)) for p in ("fp32", "int4")}
    if install:
        installed = install_default(out / BUNDLED_EXPORT)
        log(f"installed {len(installed)} files into {installed[0].parent}")
    metrics = {
        "config": config.to_dict(),
        "parameters": sum(p.numel() for p in model.lm.parameters()),
        "mtp_parameters": sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0,
        "data": streams.meta,
        "val_loss": None if config.head_only else round(val_loss, 4),
        "val_perplexity": None if config.head_only else round(math.exp(val_loss), 2),
        "export_bytes": sizes,
        "train_seconds": round(train_s),
        "total_seconds": round(time.time() - started),
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"done: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f}); exports {sizes}; {out}")
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.dense and args.install:
        parser.error("--install puts the hybrid demo model in the package; train --dense without it")
    if args.resume is None:
        config = config_from_args(args)
        out = (args.out or Path("demo-model")).resolve()
    else:
        from tools.demo_model.trainer import same_steps_until

        source, checkpoint = resume_point(args.resume.resolve())
        written, step = saved_config(checkpoint)
        config = config_from_args(args, written)
        if not same_steps_until(written, config, step):
            parser.error(
                f"{checkpoint} (step {step}) would not resume as these settings: a setting other than the "
                "schedule's changed, or the rate or row mix of a step before it differs"
            )
        out = args.out.resolve() if args.out else source
        if out != source:
            branch(source, checkpoint, out)
        elif checkpoint != source / "train" / "last.pt":
            parser.error(f"--resume {checkpoint}: give --out for the branch (the run's own last.pt stays)")
    run(config, out, install=args.install, until=args.until)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
