"""Where a run's results go besides its folder: `logger=none` or `logger=wandb`."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def log_run(cfg: DictConfig, summary: dict, out_dir: Path) -> None:
    name = cfg.logger.name
    if name == "none":
        return
    if name == "wandb":
        log_to_wandb(cfg, summary, out_dir)
        return
    raise ValueError(f"logger must be one of none, wandb; got {name!r}")


def log_to_wandb(cfg: DictConfig, summary: dict, out_dir: Path) -> None:
    """One wandb run per job: the full config, the summary, the step series and the plots.
    Offline unless `logger.mode=online`: no login, no network."""
    import csv

    import wandb

    logger_cfg = cfg.logger
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity,
                     group=logger_cfg.group, tags=list(logger_cfg.tags), mode=logger_cfg.mode,
                     dir=str(out_dir), config=OmegaConf.to_container(cfg, resolve=True),
                     reinit="finish_previous")
    try:
        run.summary.update(summary)
        steps_path = out_dir / "steps.csv"
        if steps_path.exists():
            with steps_path.open() as steps_file:
                rows = list(csv.DictReader(steps_file))
            stride = max(1, len(rows) // 5000)  # a time series, not every step of a long run
            for row in rows[::stride]:
                run.log({key: float(value) for key, value in row.items()
                         if key != "replica_id"})
        for image in sorted(out_dir.glob("*.png")):
            run.log({image.stem: wandb.Image(str(image))})
    finally:
        run.finish()
