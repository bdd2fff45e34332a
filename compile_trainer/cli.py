"""The ``compile-trainer`` command (also ``python -m compile_trainer``)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

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
    return parser


def run_explain(args: argparse.Namespace) -> int:
    from omegaconf.errors import OmegaConfBaseException

    from compile_trainer.explain import ExplainError, explain
    from compile_trainer.fit_telemetry import TelemetryConfigError
    from compile_trainer.policy import PolicyError

    try:
        from hydra.errors import HydraException

        explanation = explain(args.overrides, module=args.module, datamodule=args.datamodule, steps=args.steps)
    except (ExplainError, PolicyError, TelemetryConfigError, HydraException, OmegaConfBaseException) as error:
        print(f"compile-trainer explain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(explanation.report())
    if args.fail_on_break and explanation.graph_breaks:
        print(f"--fail-on-break: {explanation.graph_breaks} graph break(s)", file=sys.stderr)
        return EXIT_BREAKS
    return EXIT_OK


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "explain":
        return run_explain(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse only accepts known commands


if __name__ == "__main__":
    sys.exit(main())
