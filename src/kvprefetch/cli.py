"""The `kvprefetch` command line."""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command()
def version() -> None:
    """Print the version."""
    from kvprefetch import __version__

    print(__version__)


def main() -> None:
    app()
