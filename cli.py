"""The `gemrec` command. Each package registers its own subcommands; heavy imports stay inside handlers."""

import argparse
import importlib
import logging
import sys

GROUPS = {
    "data": "prepare, synthesize and inspect datasets",
    "serve": "run the gRPC feature and data services",
    "train": None,  # a single command, registered directly by the trainer
    "pipeline": "run, compile and submit the Kubeflow pipeline",
    "bench": "benchmarks (numbers go to docs/benchmarks.md)",
    "ui": None,  # a single command, registered directly by the pipelines package
}

# Modules with `register(groups: dict[str, argparse._SubParsersAction]) -> None`.
REGISTRARS = [
    "gemrec.components.data_service.cli",
    "gemrec.components.data_service.serve_cli",
    "gemrec.components.feature_service.cli",
    "gemrec.components.trainer.cli",
    "gemrec.kernels.cli",
    "gemrec.model.cli",
    "gemrec.pipelines.cli",
]


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemrec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {"_top": top}
    for name, help_text in GROUPS.items():
        if help_text is None:
            continue
        sub = top.add_parser(name, help=help_text)
        groups[name] = sub.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND", required=True)
    for module in REGISTRARS:
        try:
            registrar = importlib.import_module(module)
        except ModuleNotFoundError as err:
            # A machine with part of the stack (the GPU box has no torchrec or grpc_health) still gets
            # the commands whose dependencies are present.
            if err.name is None or err.name.split(".")[0] == "gemrec":
                raise
            logging.getLogger(__name__).debug("skipping %s: %s is not installed", module, err.name)
            continue
        registrar.register(groups)
    return parser


def configure_logging(verbose: bool, label: str = "", replace: bool = False) -> None:
    """Our own loggers speak at INFO; libraries (fbgemm, torchrec, kfp) only from WARNING unless `verbose`. `label`
    starts every line (an ensemble member's process: "member 1"). `replace`: drop the root handlers already there (a
    fresh process whose imports logged before this call: fbgemm's `logging.info` installs a default one)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format=f"%(asctime)s %(levelname)s {label + ' ' if label else ''}%(name)s: %(message)s",
        force=replace,
    )
    logging.getLogger("gemrec").setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except CLIError as err:
        print(f"gemrec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # `python -m gemrec.cli`: use the imported module so CLIError is one class
    from gemrec.cli import main as package_main

    sys.exit(package_main())
