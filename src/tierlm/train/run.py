"""A whole `tierlm train` run: train, then export, sample and summarise."""

from __future__ import annotations

from collections.abc import Callable

from tierlm.checkpoint import export_hf_from_checkpoint, last_good_checkpoint
from tierlm.config import Config
from tierlm.distributed.setup import quiet
from tierlm.node.protocol import NodeError
from tierlm.train.node import node_failure
from tierlm.train.trainer import Trainer, TrainResult


def run_training(cfg: Config, *, log: Callable[[str], None] = print) -> TrainResult:
    trainer = Trainer(cfg, log=log)
    try:
        return _run(trainer, cfg, log)
    except NodeError as exc:  # the memory node died, stalled past its timeout or refused
        raise node_failure(exc, trainer.step, cfg.memory.memory_node,
                           lambda: last_good_checkpoint(trainer.run_dir, log)) from exc
    finally:
        if trainer.node is not None:  # the node frees the session and takes the next trainer
            trainer.node.close()
        if trainer.run_lock is not None:  # held from the directory's claim to the last write
            trainer.run_lock.release()


def _run(trainer: Trainer, cfg: Config, log: Callable[[str], None]) -> TrainResult:
    if not trainer.world.is_main:
        log = quiet  # rank 0 reports and exports for the whole run
    # a resumed run starts from the last evaluation of the run it continues
    evals = {} if trainer.monitor.last_eval is None else {
        trainer.monitor.last_eval["step"]: trainer.monitor.last_eval["eval_ppl"]}
    result = trainer.train()
    # from the final checkpoint, a chunk of a tensor at a time: the weights never have to fit
    # in RAM at once
    hf_dir = (
        export_hf_from_checkpoint(result.final_checkpoint, trainer.run_dir / "hf",
                                  dtype=cfg.run.export_dtype, progress=trainer.progress)
        if trainer.world.is_main and result.final_checkpoint is not None else None
    )
    trainer.memory_watch.trim()  # a phase boundary: the export's chunks were freed
    if cfg.train.sample_tokens:  # on every rank: FSDP gathers the weights collectively
        log("sample: " + trainer.sample(cfg.train.sample_tokens).replace("\n", "\n        "))
    trainer.stepper.close()
    trainer.world.barrier()  # leave together: a rank that tears its group down early can abort
    trainer.world.close()    # another's (gloo: "terminate called without an active exception")
    if trainer.world.is_main:  # every rank has closed its files: the disk tier's can go
        engine = trainer.stepper.engine
        trainer.offload.remove(engine.store.disk_paths() if engine is not None else [], log)
    log(f"run directory: {result.run_dir}")
    log(f"checkpoint:    {result.final_checkpoint}")
    log(f"HF export:     {hf_dir}")
    if result.skipped_steps:
        log(f"skipped steps (non-finite gradients): {result.skipped_steps}")
    evals.update(result.eval_ppl)
    if evals:
        first, last = min(evals), max(evals)
        log(f"held-out perplexity: {evals[first]:.2f} at step {first} -> "
            f"{evals[last]:.2f} at step {last}")
    return result
