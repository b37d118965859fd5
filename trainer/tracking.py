"""Metrics out of the loop: `metrics.jsonl` (always, rank 0), W&B (online with a key, otherwise
offline run files in output_dir; `logging.wandb=false` turns it off), and a progress bar."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def wandb_mode() -> str:
    """online when a key is configured (env or ~/.netrc), offline otherwise."""
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read():
        return "online"
    return "offline"


class Tracker:
    """Rank 0 writes; other ranks get a Tracker(enabled=False) whose calls do nothing."""

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, start_step: int = 0,
                 use_wandb: bool = False, project: str = "posttrain", run_name: Optional[str] = None,
                 config: Optional[dict] = None, progress: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.run = None
        self.bar = None
        if not enabled:
            return
        if use_wandb:
            import wandb

            self.run = wandb.init(project=project, name=run_name, dir=output_dir, config=config,
                                  mode=wandb_mode(), resume="allow")
        if progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.run is not None:
            split = record["split"]
            self.run.log({f"{split}/{k}": v for k, v in record.items()  # numbers: an eval's outcomes string stays in
                          if k not in ("step", "split") and not isinstance(v, str)},  # metrics.jsonl
                         step=record["step"])

    def progress(self, step: int, shown: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in shown.items()})

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines past the checkpoint so metrics.jsonl reads like one unbroken run."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path) as fh:
            keep = [line for line in fh if json.loads(line)["step"] <= step]
        with open(self.path, "w") as fh:
            fh.writelines(keep)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()
