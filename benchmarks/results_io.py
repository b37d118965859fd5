"""A benchmark's result files (docs/results/...): each written aside and renamed into place, so a
reader never sees half a file and an interrupted run leaves the previous one."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional


def write_files(out_dir: str | os.PathLike, files: dict[str, str]) -> None:
    """Write {file name: text} under `out_dir` (created if needed)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, text in files.items():
        path = os.path.join(out_dir, name)
        tmp = f"{path}.{os.getpid()}.tmp"  # one per process: runs side by side may rewrite the same table
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)


def remembered(path: Optional[str], run: Callable[[], Any], runs: Optional[dict] = None) -> Any:
    """The result of `run()` (JSON-able), read from `path` when an earlier run finished it, else
    computed and written there: one file per finished run, so an interrupted benchmark goes on where it
    stopped. path None: computed, kept nowhere. A computed result's provenance (date, command, commit) is
    kept beside it (`PATH.meta`), and `runs`, when given, gets the run's own provenance under its name --
    a reused run's, never today's (None: kept before provenance was)."""
    meta_path = path + ".meta" if path else None
    if path and os.path.exists(path):
        with open(path) as fh:
            result = json.load(fh)
        meta = None
        if os.path.exists(meta_path):
            with open(meta_path) as fh:
                meta = json.load(fh)
    else:
        result = run()
        meta = provenance()
        if path:
            write_files(os.path.dirname(path), {os.path.basename(path): json.dumps(result),
                                                os.path.basename(meta_path): json.dumps(meta)})
    if runs is not None and path:
        runs[os.path.basename(path).removesuffix(".json")] = meta
    return result


def kept_runs_lines(runs: dict) -> list[str]:
    """Markdown lines naming the commit and date of each run a report reused or computed (`remembered`'s
    `runs`): one bullet per commit."""
    if not runs:
        return []
    groups: dict[tuple, list[str]] = {}
    for name, meta in runs.items():
        meta = meta or {}
        key = (str(meta.get("commit", "unknown (kept before per-run provenance)")), str(meta.get("date", "?")))
        groups.setdefault(key, []).append(name)
    lines = ["Each run at its own commit (kept runs are reused, not re-measured):", ""]
    lines += [f"- `{commit}` ({date}): {', '.join(sorted(names))}" for (commit, date), names in sorted(groups.items())]
    return lines + [""]


def provenance(script: Optional[str] = None, argv: Optional[list] = None) -> dict:
    """When, where and how a result was measured: UTC date, the command line (`script` and `argv`,
    by default the process's own), the machine (cores and the CPU's vector ISA as torch sees it),
    torch's version and the checkout's commit."""
    import platform
    import subprocess
    import sys
    import time

    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        if commit and changed:
            commit += "+changes"  # measured with uncommitted changes to tracked files
    except (OSError, subprocess.SubprocessError):
        commit = None
    script = script or (sys.argv[0] if sys.argv and sys.argv[0] else "?")
    script = os.path.relpath(os.path.abspath(script), root) if script != "?" else script
    argv = sys.argv[1:] if argv is None else argv
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(["python", script, *map(str, argv)]),
            "cores": os.cpu_count(), "cpu": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "torch": torch.__version__, "commit": commit}


def provenance_line(meta: Optional[dict]) -> str:
    """One markdown line naming a result's command, date and machine (empty when the JSON has none)."""
    if not meta:
        return ""
    at = f" at commit {meta['commit']}" if meta.get("commit") else ""
    return (f"*Measured {meta['date']} on {meta['cores']} {meta['machine']} cores ({meta['cpu']}), torch "
            f"{meta['torch']}{at}: `{meta['command']}`*")


def runs_by_commit(results: list[dict], name: Callable[[dict], str]) -> list[str]:
    """Markdown lines naming, for a table built from many result files, the commit and date each run was
    measured at (its own `meta`, never the rendering's): one bullet per commit, its runs by `name`."""
    groups: dict[tuple, list[str]] = {}
    for r in results:
        meta = r.get("meta") or {}
        commit = meta.get("commit") or "unknown (written before runs kept their provenance)"
        key = (str(commit), str(meta.get("date", "?")))
        groups.setdefault(key, []).append(name(r))
    lines = ["Each run at its own commit (its result file's `meta`):", ""]
    lines += [f"- `{commit}` ({date}): {', '.join(sorted(names))}" for (commit, date), names in sorted(groups.items())]
    return lines


def provenance_lines(meta: Optional[dict]) -> list[str]:
    """The provenance line and a blank line, for a rendered file's head; nothing when the JSON has none."""
    line = provenance_line(meta)
    return [line, ""] if line else []


def write_report(out_dir: str | os.PathLike, stem: str, report: dict, render: Callable[[dict], str]) -> None:
    """STEM.json (the report, given its provenance under "meta" unless it has one) and STEM.md (the
    report rendered) under `out_dir`, each written aside and renamed into place."""
    report.setdefault("meta", provenance())
    write_files(out_dir, {stem + ".json": json.dumps(report, indent=1, default=float), stem + ".md": render(report)})
