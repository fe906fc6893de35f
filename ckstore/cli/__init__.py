"""The ``ckstore`` command line: parse, call the library, render.

Every command here is a thin layer over the Python API; see ``ckstore --help``.
"""

from __future__ import annotations

import click

from ._common import Ctx, ErrorHandlingGroup

__all__ = ["main"]


@click.group(
    cls=ErrorHandlingGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option(
    "--store",
    "-s",
    envvar="CKSTORE_STORE",
    metavar="LOCATION",
    help="Store location: a folder or fsspec URL (env: CKSTORE_STORE).",
)
@click.option("--catalog", envvar="CKSTORE_CATALOG", metavar="URL", help="Catalog URL, when not the one the store records.")
@click.option("--run", "-r", envvar="CKSTORE_RUN", metavar="RUN", help="Default run for refs that name none.")
@click.option(
    "--version", is_flag=True, expose_value=False, is_eager=True, callback=lambda ctx, _p, v: _version(ctx, v),
    help="Show the version (and whether the compiled byte-plane kernels are in use) and exit.",
)
@click.pass_context
def main(ctx: click.Context, store: str | None, catalog: str | None, run: str | None) -> None:
    """ckstore: a content-addressed checkpoint store for PyTorch training.

    Errors print one line and exit with status 2 (CKSTORE_DEBUG=1 shows the traceback).
    """
    ctx.obj = Ctx(store, catalog, run)


def _version(ctx: click.Context, wanted: bool) -> None:
    if not wanted or ctx.resilient_parsing:
        return
    import os
    from importlib.metadata import version

    from ..format.planes import KERNEL

    if KERNEL == "compiled":
        kernels = "compiled kernels"
    elif os.environ.get("CKSTORE_EXTENSION") == "skip":
        kernels = "numpy (CKSTORE_EXTENSION=skip)"
    else:
        kernels = "numpy (the compiled kernels are not built: reinstall where a C compiler is available)"
    click.echo(f"ckstore, version {version('ckstore')}; byte planes: {kernels}")
    ctx.exit()


def _register() -> None:
    from . import _core, _demo, _diff, _durability, _gc, _io

    for mod in (_core, _demo, _diff, _gc, _io, _durability):
        for cmd in mod.COMMANDS:
            main.add_command(cmd)


_register()
