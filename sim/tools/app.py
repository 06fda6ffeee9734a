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
from sim.core.experiment import run_experiment
from sim.core.step import NoProgress


@hydra.main(version_base=None, config_path="../../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    # A user's own policy (scheduler._target_=my_policies.MyScheduler) lives in their folder.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
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
    # For sweepers that optimise (Optuna): the job's value.
    objective = cfg.get("objective", "request_throughput")
    if objective not in result.summary:
        print(f"twinserve: error: objective={objective} is not a summary key (goodput and "
              f"slo_attainment need an slo); see {out_dir / 'summary.json'}", file=sys.stderr)
        sys.exit(2)
    return float(result.summary[objective])


if __name__ == "__main__":
    main()
