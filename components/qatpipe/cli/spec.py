"""`qatpipe spec show`: the validated spec with every default filled in."""

from __future__ import annotations

import sys

from qatpipe.cli.common import add_spec_args, load_spec


def add_commands(sub) -> None:
    spec = sub.add_parser("spec", help="spec tools").add_subparsers(dest="spec_command", required=True)
    show = spec.add_parser("show", help="print the validated spec with every default filled in")
    add_spec_args(show)
    show.set_defaults(func=cmd_show)


def cmd_show(args) -> int:
    """The spec as written, with every default: it runs no stage, so it does not make the synthetic data set."""
    import yaml

    sys.stdout.write(yaml.safe_dump(load_spec(args).to_dict(), sort_keys=False))
    return 0
