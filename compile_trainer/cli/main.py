"""The ``compile-trainer`` command (also ``python -m compile_trainer``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from compile_trainer.runs.report import DEFAULT_LOSS_TOLERANCE, PLOT_FILE, ReportError, build_report
from compile_trainer.runs.report_plot import plot_report
from compile_trainer.runs.report_tables import report_markdown, report_text
from compile_trainer.runs.results import OBJECTIVES

EXIT_OK, EXIT_BREAKS, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compile-trainer", description="Declared torch.compile policies for Lightning"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain",
        help="run one training step under a policy and show graph breaks, graphs per region and fixes",
        description=(
            "Run one training step under a compile policy and print the graph breaks (reason, file:line, module), "
            "the graphs per region and suggested fixes. Overrides are those of train.py, e.g. "
            "`compile-trainer explain compile=full compile.backend=eager recipe=gpt_tiny`."
        ),
    )
    explain.add_argument("overrides", nargs="*", help="Hydra overrides of conf/config.yaml (compile=..., recipe=...)")
    explain.add_argument("--module", help="a LightningModule class or factory to explain instead, as pkg.module:Name")
    explain.add_argument("--datamodule", help="a LightningDataModule class giving the batches, as pkg.module:Name")
    explain.add_argument("--steps", type=int, default=1, help="training steps to run (default 1)")
    explain.add_argument(
        "--fail-on-break",
        action="store_true",
        help=f"exit with {EXIT_BREAKS} if there is a graph break that no `eager` rule declared (for CI)",
    )
    report = commands.add_parser(
        "report",
        help="compare the runs of a sweep (python train.py -m ...) and say which policy to use",
        description=(
            "Read the result.json files of a multirun directory and print the runs ranked by an objective: "
            "compile time, steady tokens/s and speedup over `none`, payback, recompiles, graph breaks, peak "
            "memory, final loss. Flags failed runs, losses off the `none` run's and runs set up differently; "
            "writes a plot of compile time against throughput."
        ),
    )
    report.add_argument("directory", type=Path, help="a multirun directory (multirun/<sweep name>) or a run's")
    report.add_argument(
        "--objective", default="throughput", choices=sorted(OBJECTIVES), help="what ranks the runs (default throughput)"
    )
    report.add_argument(
        "--loss-tolerance",
        type=float,
        default=DEFAULT_LOSS_TOLERANCE,
        help=f"flag final losses further than this fraction from `none`'s (default {DEFAULT_LOSS_TOLERANCE})",
    )
    report.add_argument("--plot", type=Path, help=f"where to write the plot (default <directory>/{PLOT_FILE})")
    report.add_argument("--no-plot", action="store_true", help="write no plot")
    report.add_argument("--markdown", action="store_true", help="print Markdown (to paste into docs/)")
    cache = commands.add_parser(
        "cache",
        help="list, inspect or prune the compile-cache bundles of a directory or URL",
        description="The bundles a policy's `cache.dir` holds (a local directory or an fsspec URL such as s3://...).",
    )
    actions = cache.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every bundle: key, size, date, torch, device, regions, cold compile")
    listing.add_argument("dir", help="the cache directory or URL (the policy's cache.dir)")
    inspect = actions.add_parser("inspect", help="one bundle: key, versions, regions, sections, checksums")
    inspect.add_argument("dir", help="the cache directory or URL")
    inspect.add_argument("key", help="the bundle's key (as `list` shows it)")
    prune = actions.add_parser("prune", help="delete old bundles")
    prune.add_argument("dir", help="the cache directory or URL")
    prune.add_argument("--older-than", type=float, metavar="DAYS", help="delete bundles written more than DAYS ago")
    prune.add_argument("--keep", type=int, metavar="N", help="keep only the N newest bundles")
    prune.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    return parser


def run_report(args: argparse.Namespace) -> int:
    try:
        report = build_report(args.directory, args.objective, args.loss_tolerance)
    except (ReportError, ValueError) as error:
        print(f"compile-trainer report: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    plot = None if args.no_plot else plot_report(report, args.plot or args.directory / PLOT_FILE)
    print(report_markdown(report, plot) if args.markdown else report_text(report, plot))
    return EXIT_OK


def run_explain(args: argparse.Namespace) -> int:
    from omegaconf.errors import OmegaConfBaseException

    from compile_trainer.cli.explain import ExplainError, explain
    from compile_trainer.schema import PolicyError, SettingsError

    try:
        from hydra.errors import HydraException

        explanation = explain(args.overrides, module=args.module, datamodule=args.datamodule, steps=args.steps)
    except (ExplainError, PolicyError, SettingsError, HydraException, OmegaConfBaseException) as error:
        print(f"compile-trainer explain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(explanation.report())
    if args.fail_on_break and explanation.graph_breaks:
        print(f"--fail-on-break: {explanation.graph_breaks} graph break(s)", file=sys.stderr)
        return EXIT_BREAKS
    return EXIT_OK


def run_cache(args: argparse.Namespace) -> int:
    from compile_trainer.cli.cache import CacheCommandError, inspect_bundle, list_bundles, prune_bundles

    try:
        if args.action == "list":
            print(list_bundles(args.dir))
        elif args.action == "inspect":
            print(inspect_bundle(args.dir, args.key))
        else:
            print(prune_bundles(args.dir, args.older_than, args.keep, args.dry_run))
    except (CacheCommandError, RuntimeError, OSError) as error:
        print(f"compile-trainer cache: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "explain":
        return run_explain(args)
    if args.command == "report":
        return run_report(args)
    if args.command == "cache":
        return run_cache(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse only accepts known commands


if __name__ == "__main__":
    sys.exit(main())
