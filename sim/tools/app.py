"""`twinserve`: the Hydra app. One run, or a sweep with `twinserve -m ...`."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from sim.tools.loggers import log_run
from sim.tools.console_summary import print_summary
from sim.tools.resume import clear_complete, complete_summary, mark_complete
from sim.core.experiment import run_experiment
from runtime.step import NoProgress


@hydra.main(version_base=None, config_path="../../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    # A user's own policy (scheduler._target_=my_policies.MyScheduler) lives in their folder.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    hydra_dir = None if hydra_cfg.output_subdir is None else out_dir / hydra_cfg.output_subdir
    try:
        if not isinstance(cfg.resume, bool):
            raise ValueError(f"resume must be true or false; got {cfg.resume!r}")
        summary = complete_summary(out_dir, overrides, hydra_dir) if cfg.resume else None
        if summary is not None:
            print(f"twinserve: resume: skipped, {out_dir} holds this job's complete run")
            # Hydra has just rewritten the job's .hydra files: keep those, as for a job that ran.
            mark_complete(out_dir, overrides, hydra_dir)
            return objective_value(cfg, summary, out_dir)
        clear_complete(out_dir)
        result = run_experiment(cfg, out_dir, progress=cfg.progress)
    except (ValueError, OmegaConfBaseException) as error:  # a bad setting: one line, no traceback
        print(f"twinserve: error: {error}", file=sys.stderr)
        sys.exit(2)
    except NoProgress as error:   # a policy that cannot progress: its reason, one line
        print(f"twinserve: error: {error}", file=sys.stderr)
        sys.exit(1)
    print_summary(result.summary)
    print(f"results in {out_dir}")
    log_run(cfg, result.summary, out_dir)
    mark_complete(out_dir, overrides, hydra_dir)
    return objective_value(cfg, result.summary, out_dir)


def objective_value(cfg: DictConfig, summary: dict, out_dir: Path) -> float:
    """The job's value for sweepers that optimise (Optuna): the summary's `objective` key."""
    objective = cfg.get("objective", "request_throughput")
    if objective not in summary:
        print(f"twinserve: error: objective={objective} is not a summary key (goodput and "
              f"slo_attainment need an slo); see {out_dir / 'summary.json'}", file=sys.stderr)
        sys.exit(2)
    return float(summary[objective])


if __name__ == "__main__":
    main()
