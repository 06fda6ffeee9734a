"""Hydra callbacks. `ReportCallback` writes a sweep's report (report.csv and its comparison plot,
see sim/tools/report.py) when the sweep ends, so an experiment preset ends with its figure and table:

    hydra:
      callbacks:
        report:
          _target_: sim.tools.callbacks.ReportCallback
          x_key: kv_cache.block_size
          metrics: [kv_waste_fraction, peak_num_seqs]
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from sim.tools.report import report_console, write_report
from sim.tools.sweep_jobs import ReportError


class ReportCallback(Callback):
    """Runs `write_report` (with these arguments) on the sweep folder at the end of a multirun."""

    def __init__(self, x_key: str | None = None, metrics: Any = None, title: str | None = None,
                 plot_name: str | None = None):
        self.x_key = x_key
        # Hydra hands a list from YAML over as a ListConfig; a comma string works too.
        if isinstance(metrics, str):
            metrics = [metric.strip() for metric in metrics.split(",") if metric.strip()]
        elif metrics is not None and not isinstance(metrics, (list, tuple)):
            metrics = OmegaConf.to_container(metrics)
        self.metrics = list(metrics) if metrics else None   # (None: the report's default)
        self.title = title
        self.plot_name = plot_name

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            write_report(sweep_dir, x_key=self.x_key, metrics=self.metrics, title=self.title,
                         plot_name=self.plot_name, console=report_console())
        except ReportError as error:
            # Hydra would turn an exception into a warning with a traceback-like prefix.
            print(f"twinserve-report: error: {error}", file=sys.stderr)
