"""The `hellbender` command line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from hellbender.errors import UserError

app = typer.Typer(
    help="Fine-tune and continue pretraining of language models from one YAML config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

# Not checked by click: `read_yaml` says what is wrong with the path in the one error format of the CLI.
ConfigArg = Annotated[Path, typer.Argument(help="YAML config file.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a key, e.g. --set learning_rate=1e-4 (repeatable; dotted keys reach into lists)."
    ),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks (also HELLBENDER_DEBUG=1).")]


def _find_user_error(exc: BaseException) -> UserError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _run(debug: bool, action: Callable[[], Any]) -> Any:
    """Run a command; a user error becomes one readable paragraph and exit code 2 (traceback with --debug)."""
    debug = debug or os.environ.get("HELLBENDER_DEBUG", "") not in ("", "0")
    try:
        return action()
    except Exception as exc:
        user_error = _find_user_error(exc)
        if user_error is None or debug:
            raise
        _close_progress_bars()
        err_console.print("error:", style="bold red", end=" ")
        err_console.print(str(user_error), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(user_error.exit_code) from None


def _close_progress_bars() -> None:
    """An error raised inside a loop leaves its tqdm bar open, without a newline; closing it ends the line, so the
    error paragraph starts on a line of its own."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _setup_logging() -> None:
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    logging.getLogger("hellbender").setLevel(logging.INFO)


@app.command()
def train(config: ConfigArg, set_: SetOpt = None, debug: DebugOpt = False) -> None:
    """Train the model the config describes and save it in `output_dir`."""
    from hellbender.config import load_config

    def action() -> None:
        cfg = load_config(config, set_)
        _setup_logging()
        from hellbender.train.run import train as run_training

        metrics = run_training(cfg)
        if metrics.get("exit_code"):  # stopped by SIGTERM / SIGINT after saving a checkpoint
            raise typer.Exit(metrics["exit_code"])
        console.print(f"[green]done[/]: saved to {cfg.output_dir}")
        console.print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=1))

    _run(debug, action)


@app.command()
def preprocess(config: ConfigArg, set_: SetOpt = None, debug: DebugOpt = False) -> None:
    """Tokenize and cache the datasets, then print what was kept and dropped."""
    from hellbender.config import load_config

    def action() -> None:
        cfg = load_config(config, set_)
        if (cfg.uses_streaming or cfg.skip_prepare_dataset) and not cfg.test_datasets:
            why = "streamed at training time" if cfg.uses_streaming else "used as they are (`skip_prepare_dataset`)"
            console.print(f"The training rows are {why}; there is nothing to prepare.")
            return
        from hellbender.data.prepare import prepare_datasets
        from hellbender.models.loading import load_tokenizer_and_processor

        prepared = prepare_datasets(cfg, *load_tokenizer_and_processor(cfg))
        console.print(format_stats(prepared.stats, prepared.cache_dir, prepared.from_cache))

    _run(debug, action)


def format_stats(stats: dict[str, Any], cache_dir: Path, from_cache: bool) -> str:
    lines = [f"prepared data: {cache_dir} ({'reused from cache' if from_cache else 'newly written'})"]
    for split in ("train", "eval"):
        s = stats.get(split)
        if not s:
            continue
        lines.append(
            f"{split}: {s['rows_in']} rows read, {s['rows_kept']} kept, {s['tokens']} tokens, "
            f"{s['trainable_tokens']} trainable tokens"
        )
        lines += [f"  dropped {n}: {reason}" for reason, n in sorted(s["rows_dropped"].items())]
    lines.append(f"training rows: {stats['train_rows']}; evaluation rows: {stats['eval_rows']}")
    if stats.get("packed_bins") is not None:
        lines.append(f"packed into {stats['packed_bins']} bins")
    return "\n".join(lines)


@app.command()
def validate(config: ConfigArg, set_: SetOpt = None, debug: DebugOpt = False) -> None:
    """Check a config without loading the model or data; print the resolved config."""
    from hellbender.config import dump_config, load_config

    _run(debug, lambda: sys.stdout.write(dump_config(load_config(config, set_))))


@app.command()
def schema(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the Markdown reference (docs/config.md).")
    ] = False,
) -> None:
    """Print the config's JSON schema (for editors), or its Markdown reference."""
    from hellbender.config.reference import config_json_schema, config_markdown

    sys.stdout.write(config_markdown() if markdown else json.dumps(config_json_schema(), indent=2) + "\n")


@app.command()
def examples(
    name: Annotated[str | None, typer.Argument(help="Example to copy (see the list).")] = None,
    dest: Annotated[Path, typer.Option("--dest", help="Directory to copy into.")] = Path("examples"),
) -> None:
    """List the bundled example configs, or copy one (with its data) into a directory."""
    root = resources.files("hellbender") / "examples"
    configs = sorted(p.name for p in root.iterdir() if p.name.endswith(".yml"))
    if name is None:
        for config_name in configs:
            first = (root / config_name).read_text().splitlines()[0].lstrip("# ")
            console.print(f"{config_name:32} {first}", highlight=False)
        return
    file_name = name if name.endswith(".yml") else f"{name}.yml"
    if file_name not in configs:
        err_console.print(f"[bold red]error:[/] no example `{name}`; choose one of: {', '.join(configs)}")
        raise typer.Exit(2)
    dest.mkdir(parents=True, exist_ok=True)
    # Data paths in the examples are relative to the directory above `examples/`; point them at the copy.
    text = (root / file_name).read_text().replace("examples/data/", f"{dest.as_posix()}/data/")
    (dest / file_name).write_text(text)
    data_dest = dest / "data"
    if not data_dest.exists():
        with resources.as_file(root / "data") as data_src:
            shutil.copytree(data_src, data_dest)
    console.print(f"copied {file_name} to {dest}")


def main() -> None:
    app()
