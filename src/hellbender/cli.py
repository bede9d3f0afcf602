"""The `hellbender` command line."""

from __future__ import annotations

import json
import logging
import os
import re
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


def _print_version(value: bool) -> None:
    if value:
        from hellbender import __version__

        console.print(f"hellbender {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Fine-tune and continue pretraining of language models from one YAML config."""


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


def _load_config(config: Path, overrides: list[str] | None) -> Any:
    """The config as every command reads it: validated, with the memory planner choosing its `auto` values."""
    from hellbender.config import load_config
    from hellbender.plan.auto import choose

    return load_config(config, overrides, choose)


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


def _asks_for_ray(config: Path, set_: list[str] | None) -> bool:
    """Whether the run goes through Ray, which hands out the machine's GPUs itself (read before validation)."""
    from hellbender.config.overrides import apply_overrides
    from hellbender.config.yaml_file import read_yaml
    from hellbender.errors import UserError

    try:
        return apply_overrides(read_yaml(config), list(set_ or [])).get("use_ray") is True
    except UserError:
        return False  # validation reports it


@app.command()
def train(
    config: ConfigArg,
    set_: SetOpt = None,
    debug: DebugOpt = False,
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="Training processes on this machine (DDP).")] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Machines taking part (torchrun).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This machine's index (torchrun).")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", help="Address of machine 0 (torchrun).")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option("--master-port", help="Free port on machine 0 (torchrun).")] = 29500,
) -> None:
    """Train the model the config describes and save it in `output_dir`."""
    from hellbender.launch import Launch

    launch = Launch(nproc, nnodes, node_rank, master_addr, master_port)

    def action() -> None:
        from hellbender.plan.allocator import set_default_allocator_settings

        set_default_allocator_settings()  # before anything starts CUDA; launched processes inherit it
        restricted = None
        if not launch.needed and not _asks_for_ray(config, set_):
            from hellbender.train.distributed import one_gpu_for_one_process

            restricted = one_gpu_for_one_process()  # before validation starts CUDA (it reads the GPU's bf16 support)
        cfg = _load_config(config, set_)
        from hellbender.train.deepspeed import require_deepspeed_package

        require_deepspeed_package(cfg)  # before any process is launched or any data prepared
        if cfg.hub_model_id:  # before any process is launched; each process checks again as it starts
            from hellbender.errors import EnvironmentProblem
            from hellbender.train.hub import hub_problem

            if problem := hub_problem(cfg):
                raise EnvironmentProblem(problem)
        if cfg.gpu_memory_limit is not None and launch.needed:  # once, before the processes start
            from hellbender.plan.budget import refuse_what_does_not_fit

            refuse_what_does_not_fit(cfg, nproc * nnodes)
        if cfg.use_ray:  # Ray Train starts the training processes itself
            from hellbender.train.ray_launch import refuse_other_launchers
            from hellbender.train.ray_launch import train_with_ray as run_training

            refuse_other_launchers(nproc, nnodes)
        elif launch.needed:  # checked once here, then every process loads it again
            overrides = [part for item in set_ or [] for part in ("--set", item)]
            raise typer.Exit(launch.run(["train", str(config), *overrides, *(["--debug"] if debug else [])]))
        else:
            from hellbender.train.run import train as run_training
        _setup_logging()
        if restricted:
            logging.getLogger("hellbender").warning(restricted)
        metrics = run_training(cfg)
        from hellbender.train.distributed import close_process_group

        close_process_group()  # a process of `--nproc N`: leaves with the others
        if metrics.get("exit_code"):  # stopped by a signal or the loss watchdog, after saving a checkpoint
            raise typer.Exit(metrics["exit_code"])
        from hellbender.train.report import REPORT_DIR, SUMMARY_NAME

        report = Path(cfg.output_dir) / REPORT_DIR / SUMMARY_NAME
        console.print(f"[green]done[/]: the model is in {cfg.output_dir}; the run report is {report}", soft_wrap=True)
        learned = _preference_summary(Path(cfg.output_dir))
        if learned:
            console.print(f"learned: {learned}", highlight=False, soft_wrap=True)
        console.print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=1))

    _run(debug, action)


@app.command()
def preprocess(config: ConfigArg, set_: SetOpt = None, debug: DebugOpt = False) -> None:
    """Tokenize and cache the datasets, then print what was kept and dropped."""

    def action() -> None:
        cfg = _load_config(config, set_)
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


@app.command("merge-lora")
def merge_lora(
    config: ConfigArg,
    adapter: Annotated[
        Path | None,
        typer.Option(
            "--adapter", help="Adapter directory: a `checkpoint-N` or a run's output (default: `output_dir`)."
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", help="Where to save the merged model (default: `<output_dir>/merged`).")
    ] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard.")] = "5GB",
    set_: SetOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Merge the trained LoRA adapter into the base model and save a standalone model."""

    def action() -> None:
        cfg = _load_config(config, set_)
        _setup_logging()
        from hellbender.use.merge import merge_lora as run_merge

        target = run_merge(cfg, adapter, output, max_shard_size)
        console.print(f"[green]merged[/]: {target}", highlight=False, soft_wrap=True)

    _run(debug, action)


@app.command("quantize")
def quantize(
    config: ConfigArg,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="The trained model: a `checkpoint-N`, a merged model or a run's output (default: `output_dir`); a "
            "LoRA adapter is merged into `base_model` first.",
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", help="Where to save the quantized model (default: `<output_dir>/quantized`)."),
    ] = None,
    set_: SetOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Store the trained model quantized with torchao (the `qat:` scheme it trained against, or `quantization:`)."""

    def action() -> None:
        cfg = _load_config(config, set_)
        _setup_logging()
        from hellbender.use.quantize import quantize as run_quantize

        target = run_quantize(cfg, model, output)
        console.print(f"[green]quantized[/]: {target}", highlight=False, soft_wrap=True)

    _run(debug, action)


@app.command("distill-logprobs")
def distill_logprobs(
    config: ConfigArg,
    teacher: Annotated[str, typer.Option("--teacher", help="The teacher: a hub id or a model directory.")],
    top_k: Annotated[int, typer.Option("--top-k", help="How many of the teacher's tokens to keep per position.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Where to write the rows (default: `<dataset_prepared_path>/teacher_logprobs`)."),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Rows per teacher forward pass.")] = 8,
    set_: SetOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Write a teacher's top-k log-probabilities for the config's datasets, as offline distillation rows.

    The teacher runs forward over each row as the config tokenizes it (no generation). A rerun continues where a
    stopped one left off. The config's own distillation keys are ignored."""
    from hellbender.config import validate_config
    from hellbender.config.overrides import apply_overrides
    from hellbender.config.yaml_file import read_yaml

    def action() -> None:
        from hellbender.use.distill_logprobs import LOGPROBS_FIELD, teacher_pass_config
        from hellbender.use.distill_logprobs import distill_logprobs as run_pass

        cfg = validate_config(teacher_pass_config(apply_overrides(read_yaml(config), set_ or [])))
        _setup_logging()
        written = run_pass(cfg, teacher, top_k, out, batch_size)
        console.print("[green]written[/]; train on them with `kd_trainer: true` and these entries:", highlight=False)
        blocks: dict[str, list[str]] = {}
        for name, path in written:
            key, index = name.rsplit("-", 1)
            entry = getattr(cfg, key)[int(index)]
            blocks.setdefault(key, []).append(
                f"  - path: {path}\n    type: {entry.type or 'pretokenized'}\n    logprobs_field: {LOGPROBS_FIELD}"
            )
        for key, lines in blocks.items():
            console.print(f"{key}:\n" + "\n".join(lines), highlight=False, soft_wrap=True)

    _run(debug, action)


@app.command()
def consolidate(
    config: ConfigArg,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="A `checkpoint-N` written with FSDP2 sharded state dicts (default: the newest in `output_dir`).",
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", help="Where to save the whole model (default: `<output_dir>/consolidated`)."),
    ] = None,
    set_: SetOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Join an FSDP2 sharded checkpoint into one model (or adapter) that transformers and PEFT load."""

    def action() -> None:
        cfg = _load_config(config, set_)
        _setup_logging()
        from hellbender.use.consolidate import consolidate as run_consolidate

        target = run_consolidate(cfg, checkpoint, output)
        console.print(f"[green]consolidated[/]: {target}", highlight=False, soft_wrap=True)

    _run(debug, action)


ModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--model",
        "--checkpoint",
        help="A `checkpoint-N` directory or a merged model to use instead of the final model in `output_dir`.",
    ),
]


@app.command()
def inference(
    config: ConfigArg,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Answer this prompt.")] = None,
    prompts_file: Annotated[
        Path | None,
        typer.Option(
            "--prompts-file", help='Answer each prompt of a file: one per line, or .jsonl with {"prompt": ...}.'
        ),
    ] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Chat interactively; the conversation is kept.")] = False,
    image: Annotated[
        list[Path] | None, typer.Option("--image", help="An image for the prompt (vision-language models; repeatable).")
    ] = None,
    system: Annotated[str | None, typer.Option("--system", help="A system message before the conversation.")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Give the prompt to the model as it is, without the chat template.")
    ] = False,
    model: ModelOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Most tokens to generate per answer.")] = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0 decodes greedily (deterministic); above 0 samples.")
    ] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with a temperature above 0).")] = 1.0,
    set_: SetOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Answer prompts with the trained model (base + adapter, a checkpoint or a merged model), streaming the text."""

    def action() -> None:
        chosen = [name for name, given in (("--prompt", prompt), ("--prompts-file", prompts_file)) if given]
        if len(chosen) > 1 or (chat and prompts_file):
            raise UserError(
                "Give one of `--prompt`, `--prompts-file` or `--chat` (`--chat` may start with `--prompt`)."
            )
        if not chosen and not chat:
            raise UserError("Nothing to answer: give `--prompt TEXT`, `--prompts-file FILE` or `--chat`.")
        if raw and chat:
            raise UserError(
                "`--raw` answers single prompts without the chat template; it cannot be used with `--chat`."
            )
        cfg = _load_config(config, set_)
        from hellbender.use import inference as use

        settings = use.GenerationSettings(max_new_tokens, temperature, top_p)
        images = use.load_images(cfg, list(image or []))
        prompts = use.read_prompts(prompts_file) if prompts_file else []
        _setup_logging()
        generator = use.Generator(cfg, model)
        if chat:
            err_console.print(use.CHAT_HELP, highlight=False)
            conversation = use.Conversation(generator.multimodal, system, images)
            use.chat(generator, conversation, settings, first=prompt)
            return
        for text in prompts or [prompt]:
            if prompts:
                use.write_stdout(f"### {text}\n")
            use.answer(generator, text, images, settings, system, raw, write=use.write_stdout)
            if prompts:
                use.write_stdout("\n")

    _run(debug, action)


@app.command()
def evaluate(
    config: ConfigArg,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            "--model",
            help="A `checkpoint-N` directory or a merged model to score instead of the final model in `output_dir`.",
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", help="Where to write the metrics (default: `<output_dir>/eval_results.json`)."),
    ] = None,
    set_: SetOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Score the trained model on the config's evaluation data: loss, perplexity, token accuracy (JSON); after
    preference tuning or a reward model: preference accuracy, mean reward margin and the method's loss; after online
    RL: the mean reward of completions generated for the evaluation prompts."""

    def action() -> None:
        from hellbender.train.distributed import one_gpu_for_one_process

        restricted = one_gpu_for_one_process()  # before validation starts CUDA
        cfg = _load_config(config, set_)
        _setup_logging()
        from hellbender.use.evaluate import evaluate as run_evaluation

        if restricted:
            logging.getLogger("hellbender").warning(restricted)

        results = run_evaluation(cfg, checkpoint, output)
        sys.stdout.write(json.dumps(results, indent=1) + "\n")  # not rich: it would wrap long lines inside the JSON

    _run(debug, action)


@app.command()
def validate(
    config: ConfigArg,
    set_: SetOpt = None,
    debug: DebugOpt = False,
    print_: Annotated[
        bool, typer.Option("--print", help="Print the resolved config (every key, as it will run) as YAML.")
    ] = False,
    output: Annotated[Path | None, typer.Option("--output", help="Write the resolved config to this file.")] = None,
) -> None:
    """Check a config without loading the model or data; end with one verdict line."""
    from hellbender.config import dump_config
    from hellbender.config.machine import this_machine

    def action() -> None:
        cfg = _load_config(config, set_)
        from hellbender.config.deepspeed import deepspeed_notices
        from hellbender.config.machine_needs import machine_notices

        for notice in deepspeed_notices(cfg) + machine_notices(cfg):  # `train` stops on them instead
            logging.getLogger("hellbender").warning(notice)
        _check_layer_counts(cfg)
        resolved = dump_config(cfg, this_machine())
        if output is not None:
            output.write_text(resolved)
        if print_:
            sys.stdout.write(resolved)
        method = {"lora": "LoRA", "qlora": "QLoRA", None: "full fine-tuning"}[cfg.adapter]
        if cfg.rl:  # the preference method, where there is one
            method = f"{cfg.rl.upper()}, {method}"
        elif cfg.reward_model:
            method = f"reward model, {method}"
        data = len(cfg.datasets) + len(cfg.pretraining_dataset)
        more = "" if print_ or output else "; `--print` shows every key as it will run"
        # A YAML comment, so `--print`'s output still reads as YAML.
        sys.stdout.write(
            f"# valid: {config} ({method} of {cfg.base_model}, {data} dataset{'s' if data != 1 else ''}){more}\n"
        )

    _run(debug, action)


def _check_layer_counts(cfg: Any) -> None:
    """`validate` refuses layer counts the model cannot take, as `train` does, where the model's config is on this
    machine (a local model, or a hub id in the cache: `validate` stays offline); where it is not, it says so."""
    if not cfg.sets_layer_counts:
        return
    from hellbender.models.activation_checkpointing import check_layer_counts
    from hellbender.models.loading import config_on_this_machine, model_skeleton

    source = config_on_this_machine(cfg)
    if source is None:
        logging.getLogger("hellbender").warning(
            "The layer counts (`gradient_checkpointing_layers`, `activation_offload_layers`) were not checked against "
            "`%s`, whose config is not on this machine (validate does not download); `train` checks them before its "
            "data work.",
            cfg.base_model,
        )
        return
    check_layer_counts(cfg, model_skeleton(cfg, source))


@app.command()
def plan(
    config: ConfigArg,
    set_: SetOpt = None,
    debug: DebugOpt = False,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="Card to plan for: H100, H200, A100, L4, ... (default: this one's).")
    ] = None,
    gpu_memory: Annotated[
        float | None, typer.Option("--gpu-memory", min=0.1, help="GPU memory in GiB to fit (default: the card's).")
    ] = None,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs training together (DDP, FSDP2, ZeRO).")] = 1,
) -> None:
    """Predict peak GPU memory, host memory and step time without loading weights or data; say whether it fits."""

    def action() -> None:
        cfg = _load_config(config, set_)
        from hellbender.plan.budget import plan_for
        from hellbender.plan.report import render

        result = plan_for(cfg, gpu, gpu_memory, gpus)
        sys.stdout.write(render(result))
        if not result.fits:
            raise typer.Exit(1)

    _run(debug, action)


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
    # Data paths in the examples start from the directory above `examples/`; in the copy they start from `dest`.
    text = (root / file_name).read_text()
    (dest / file_name).write_text(text.replace("examples/data/", "data/"))
    with resources.as_file(root / "data") as data_src:
        for used in _example_data(text, data_src):
            target = dest / "data" / used.relative_to(data_src)
            target.parent.mkdir(parents=True, exist_ok=True)
            if used.is_dir():
                shutil.copytree(used, target, dirs_exist_ok=True)
            else:
                shutil.copyfile(used, target)
    for module in re.findall(r"\b([A-Za-z_]\w*)\.\w+", _reward_funcs_text(text)):  # `trl.reward_funcs` files
        if (root / f"{module}.py").is_file():
            (dest / f"{module}.py").write_text((root / f"{module}.py").read_text())
    console.print(
        f"copied {file_name} and its data to {dest}: run `cd {dest} && hellbender train {file_name}`",
        highlight=False,
        soft_wrap=True,
    )


def _preference_summary(output_dir: Path) -> str | None:
    """The final preference accuracy and margin of a preference-tuning run, from its saved trainer state."""
    from hellbender.train.preference_outcome import preference_summary

    state = output_dir / "trainer_state.json"
    return preference_summary(json.loads(state.read_text())["log_history"]) if state.is_file() else None


def _reward_funcs_text(config_text: str) -> str:
    """The `reward_funcs:` line of an example config (its reward files are copied beside it)."""
    return "\n".join(line for line in config_text.splitlines() if line.strip().startswith("reward_funcs:"))


def _example_data(config_text: str, data_src: Path) -> list[Path]:
    """The bundled data files an example config names, and the image folders their rows point into."""
    import re

    files = sorted({data_src / name for name in re.findall(r"examples/data/([\w./-]+)", config_text)})
    folders = {
        data_src / folder
        for file in files
        if file.is_file()
        for folder in re.findall(r'"([\w-]+)/[\w.-]+\.(?:png|jpe?g)"', file.read_text())
    }
    return files + sorted(folder for folder in folders if folder.is_dir())


# Library warnings a user can do nothing about, printed on every run otherwise: PEFT (0.21) reads transformers'
# deprecated `is_gradient_checkpointing` property when it wraps a model, and TRL (1.16) around each reference pass.
QUIET_WARNINGS = (r"`is_gradient_checkpointing` is deprecated",)
# Library loggers whose warnings concern paths hellbender never takes: bitsandbytes' CPU backend says on import that
# its hub kernel for 4-bit matmuls on CPU is missing, and hellbender runs 4-bit weights on CUDA only.
QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)
# Single messages of library loggers, printed whenever transformers' model code is imported with torchao installed
# (the `qat` extra) under torch 2.13: torchao 0.18's prebuilt C++ extensions target torch 2.11 and do not load (its
# Python quantization, which the int8 / int4 schemes run on a CPU, does; a scheme whose GPU kernel lives in one of
# them fails where it calls it, naming the operator), and its Enum registrations meet torch's deprecation.
QUIET_LOG_MESSAGES = {
    "torchao": r"Failed to load .*_C\w*\.(?:[\w-]+\.)?so",
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported",
}


def _drop_messages(logger_name: str, pattern: str) -> None:
    expression = re.compile(pattern)
    logging.getLogger(logger_name).addFilter(lambda record: not expression.search(record.getMessage()))


def main() -> None:
    import warnings

    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, pattern in QUIET_LOG_MESSAGES.items():
        _drop_messages(name, pattern)
    app()
