"""`RecipeArgumentParser`: a YAML `--config` whose keys become the parser's defaults, overridable from the command line.

The recipes describe their options as dataclasses (as `TrainingArguments` does) and read them with
[`~transformers.HfArgumentParser`]. A YAML file holds a flat mapping `option: value`; every value is turned into the
command-line tokens it stands for and placed *before* the real command line, so a flag given on the command line wins
(argparse keeps the last occurrence), and YAML values go through exactly the same type conversion and `choices`
checks as flags do. Mistakes are reported before anything is loaded or trained, as a [`ConfigError`] that names the
file and the key: an unknown key (with the closest valid one), a value of the wrong type, a list for a single-valued
option, `null` for an option that cannot be `None`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser


class ConfigError(ValueError):
    """A bad configuration (YAML file or command line), found before training starts."""


class RecipeArgumentParser(HfArgumentParser):
    """
    [`~transformers.HfArgumentParser`] that reads `--config path.yaml` (a flat mapping of option names to values)
    as defaults for the command line, TRL-style. Errors raise [`ConfigError`] instead of exiting, so callers (and
    tests) can report them; `--help` still prints and exits.

    Args:
        dataclass_types (`Iterable[type]`): the dataclasses whose fields are the options.
        default_config (`str` or `Path`, *optional*): YAML read when the command line has no `--config`.
        **kwargs: passed to `HfArgumentParser`.

    Example:

    ```python
    >>> from dataclasses import dataclass
    >>> from harness.config import RecipeArgumentParser
    >>> @dataclass
    ... class Args:
    ...     max_length: int = 128
    >>> (args,) = RecipeArgumentParser([Args]).parse_recipe_args(["--max_length", "64"])
    >>> args.max_length
    64
    ```
    """

    def __init__(
        self,
        dataclass_types: Iterable[type],
        *,
        default_config: str | Path | None = None,
        run_defaults: dict[str, Any] | None = None,
        fixed: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        dataclass_types = list(dataclass_types)
        kwargs.setdefault("usage", "%(prog)s [--config YAML] [--option VALUE ...] (options below)")
        super().__init__(dataclass_types, **kwargs)
        self.default_config = None if default_config is None else Path(default_config)
        # `run_defaults`: what the recipe runs when neither the YAML nor the command line says otherwise (the YAML
        # may override them). `fixed`: set by the recipe for every arm whatever the YAML or the command line say.
        # Both become the parser's defaults so that `--help` shows the values that run.
        self.run_defaults = dict(run_defaults or {})
        self.fixed = dict(fixed or {})
        self.set_defaults(**self.run_defaults, **self.fixed)
        actions = self._actions_by_dest()
        for name in self.fixed:
            actions[name].help = f"{actions[name].help or ''} Fixed by the recipe for every arm."
        if "output_dir" in actions:
            actions["output_dir"].help = (
                "The parity report, its plots and the saved model of the accumulated arm go here; each arm trains "
                "in <output_dir>/arms/<arm>/."
            )
        # Listed for `--help` only: `parse_recipe_args` takes `--config` out of the command line before parsing.
        self.add_argument(
            "--config",
            metavar="YAML",
            default=None if default_config is None else _display_path(self.default_config),
            help="YAML file of `option: value` lines that become the defaults of all other options (command-line "
            "flags override them). The defaults shown by --help are the ones that run: this file's values on top "
            "of the dataclasses' own.",
        )
        self._group_stock_options(dataclass_types)

    def error(self, message: str):  # noqa: D401 - argparse API
        # argparse prints usage and calls `sys.exit(2)`; we raise so the caller can prefix the file and key.
        raise ConfigError(message)

    # ------------------------------------------------------------------ public API
    def parse_recipe_args(self, argv: Sequence[str] | None = None) -> tuple[Any, ...]:
        """
        Parse `--config` (or `default_config`) and the command line into one instance per dataclass.

        Args:
            argv (`Sequence[str]`, *optional*): the command line without the program name; `sys.argv[1:]` if `None`.

        Returns:
            `tuple`: one instance of each dataclass, in the order given to the constructor.

        Raises:
            [`ConfigError`]: unknown key or flag, wrong type, or a value rejected by a dataclass's `__post_init__`.
        """
        import sys

        argv = list(sys.argv[1:] if argv is None else argv)
        config_path, argv = split_config_flag(argv)
        if config_path is None and self.default_config is not None:
            config_path = self.default_config
        config_tokens: list[str] = []
        if config_path is not None:
            config_tokens = self.config_to_tokens(config_path)
            # The YAML's values become the parser's defaults, so `--help` shows what actually runs (TRL's
            # `TrlParser` does the same). Parsing still puts the YAML tokens first, so flags win.
            self.set_defaults(**self._typed_values(config_tokens))
            self.set_defaults(config=_display_path(Path(config_path)), **self.fixed)
        source = f"{config_path} + command line" if config_path is not None else "command line"
        try:
            *parsed, remaining = self.parse_args_into_dataclasses(
                args=config_tokens + argv, return_remaining_strings=True
            )
        except ConfigError as error:
            raise ConfigError(f"Invalid command line: {_short_argparse_message(error)}") from None
        except (ValueError, TypeError) as error:
            # Raised by a dataclass's `__post_init__` (e.g. GradAccumArguments' validation).
            raise ConfigError(f"Invalid configuration ({source}): {error}") from error
        if remaining:
            actions = self._actions_by_dest()
            flags = [arg for arg in remaining if arg.startswith("-")] or remaining
            raise ConfigError(
                "Invalid command line: "
                + "; ".join(_unknown_key_message(flag.lstrip("-").split("=")[0], actions, flag) for flag in flags)
            )
        # `--config` is listed by the parser (for `--help`) but belongs to no dataclass: HfArgumentParser returns it
        # in an extra Namespace, which is not one of the recipe's arguments.
        return tuple(p for p in parsed if not isinstance(p, argparse.Namespace))

    def config_to_tokens(self, path: str | Path) -> list[str]:
        """
        Read a YAML config and return the command-line tokens it stands for, after checking every key and value.

        Args:
            path (`str` or `Path`): the YAML file, a flat mapping `option: value`.

        Returns:
            `list[str]`: e.g. `["--learning_rate", "5e-05", "--arms", "reference", "accumulated"]`.
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file not found: {path}")
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        config = {} if config is None else config
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: expected a mapping of option names to values, got {type(config).__name__}.")

        actions = self._actions_by_dest()
        unknown = [key for key in config if key not in actions]
        if unknown:
            raise ConfigError(f"{path}: " + "; ".join(_unknown_key_message(key, actions) for key in unknown))

        tokens: list[str] = []
        for key, value in config.items():
            action = actions[key]
            if value is None:
                if action.default is not None:
                    raise ConfigError(f"{path}: key {key!r} cannot be null (its default is {action.default!r}).")
                continue  # None is the default already
            key_tokens = _value_to_tokens(key, value, action, path)
            self._check_tokens(key, key_tokens, path)
            tokens += key_tokens
        return tokens

    # ------------------------------------------------------------------ helpers
    def _group_stock_options(self, dataclass_types: list[type]) -> None:
        """`--help` lists the recipe's own options first; the stock `TrainingArguments` options that the recipe only
        passes through to `transformers.Trainer` follow under their own heading."""
        from transformers import TrainingArguments

        stock_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
        own = {f.name for t in dataclass_types if dataclasses.is_dataclass(t) for f in dataclasses.fields(t)}
        own = (own - stock_fields) | set(self.run_defaults) | set(self.fixed)
        if self.default_config is not None and self.default_config.is_file():
            own |= set(yaml.safe_load(self.default_config.read_text()) or {})
        main = next(g for g in self._action_groups if g.title in ("options", "optional arguments"))
        stock = self.add_argument_group(
            "stock TrainingArguments options",
            "Passed unchanged to transformers.TrainingArguments (see its documentation); the recipe sets none of them.",
        )
        keep = []
        for action in main._group_actions:
            is_stock = action.dest in stock_fields and action.dest not in own
            (stock._group_actions if is_stock else keep).append(action)
        # `--config` first: it decides every other default.
        keep.sort(key=lambda action: action.dest != "config")
        main._group_actions[:] = keep

    def _typed_values(self, tokens: list[str]) -> dict[str, Any]:
        """The options set by `tokens`, converted by their actions exactly as on the command line."""
        namespace, _ = self.parse_known_args(tokens)
        given = {token[2:].split("=")[0] for token in tokens if token.startswith("--")}
        return {dest: value for dest, value in vars(namespace).items() if dest in given}

    def _actions_by_dest(self) -> dict[str, argparse.Action]:
        # Only the real options: `no_*` complements of booleans share the dest of the option they negate.
        return {
            a.dest: a
            for a in self._actions
            if a.option_strings
            and a.dest not in ("help", "config")
            and not any(s.startswith("--no_") for s in a.option_strings)
        }

    def _check_tokens(self, key: str, tokens: list[str], path: Path) -> None:
        # Parse this key alone so that a bad value is reported with its file and key, not as a command-line error.
        try:
            _, extras = self.parse_known_args(tokens)
        except ConfigError as error:
            # "argument --max_length/--max-length: invalid int value: 'x'" -> "invalid int value: 'x'"
            message = re.sub(r"^argument [^:]+: ", "", str(error))
            raise ConfigError(f"{path}: key {key!r}: {message}") from None
        if extras:
            raise ConfigError(f"{path}: key {key!r}: could not use the value(s) {extras}.")


def split_config_flag(argv: Sequence[str]) -> tuple[Path | None, list[str]]:
    """
    Remove `--config PATH` (or `--config=PATH`) from `argv`.

    Returns:
        `tuple`: the config path (or `None`) and the remaining arguments.

    Example:

    ```python
    >>> from harness.config import split_config_flag
    >>> split_config_flag(["--config", "a.yaml", "--seed", "1"])
    (PosixPath('a.yaml'), ['--seed', '1'])
    ```
    """
    rest: list[str] = []
    path: Path | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("`--config` needs a path to a YAML file.")
            path = Path(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _display_path(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (shorter in `--help` and reports)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unknown_key_message(key: Any, actions: dict[str, argparse.Action], flag: str | None = None) -> str:
    close = difflib.get_close_matches(str(key).replace("-", "_"), list(actions), n=1)
    if flag is not None:  # a command-line flag
        hint = f" (did you mean --{close[0]}?)" if close else ""
        return f"unknown option {flag}{hint}; see `--help`"
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; valid keys are the recipe's command-line options, see `--help`"


def _short_argparse_message(error: Exception) -> str:
    # "argument --max_length/--max-length: invalid int value: 'x'" -> "--max_length: invalid int value: 'x'"
    return re.sub(r"^argument (--[^/: ]+)(/[^:]+)?: ", r"\1: ", str(error))


def _value_to_tokens(key: str, value: Any, action: argparse.Action, path: Path) -> list[str]:
    takes_list = action.nargs in ("+", "*")
    if isinstance(value, (list, tuple)):
        if not takes_list:
            raise ConfigError(f"{path}: key {key!r} takes a single value, got the list {list(value)!r}.")
        if not value and action.nargs == "+":
            raise ConfigError(f"{path}: key {key!r} needs at least one value, got an empty list.")
        return [f"--{key}", *(_scalar_token(key, v, path) for v in value)]
    if isinstance(value, dict):
        # Dict-valued TrainingArguments fields (e.g. `lr_scheduler_kwargs`) accept a JSON string.
        return [f"--{key}", json.dumps(value)]
    return [f"--{key}", _scalar_token(key, value, path)]


def _scalar_token(key: str, value: Any, path: Path) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ConfigError(f"{path}: key {key!r}: unsupported value {value!r} ({type(value).__name__}).")


def dataclass_field_names(*dataclass_types: type) -> set[str]:
    """All field names of the given dataclasses (the valid YAML keys of a recipe)."""
    return {f.name for cls in dataclass_types for f in dataclasses.fields(cls)}


def check_sources_and_rate(*, model: str | None, dataset: str | None, learning_rate: float) -> None:
    """
    What the configuration names outside itself, checked in milliseconds before any arm starts: the model and the
    dataset (a path that exists, a cached Hub id, or a Hub id while the Hub is reachable) and a learning rate that
    can train. Raises a one-line [`ConfigError`] naming the option.

    Example:

    ```python
    >>> from harness.config import ConfigError, check_sources_and_rate
    >>> try:
    ...     check_sources_and_rate(model=None, dataset=None, learning_rate=0.0)
    ... except ConfigError as error:
    ...     print(error)
    --learning_rate must be > 0 (a rate of 0 leaves the model unchanged: nothing to compare), got 0.0.
    ```
    """
    from hf_gradaccum.input_checks import InputError, check_dataset_source, check_model_source

    if not learning_rate > 0:  # also NaN
        raise ConfigError(
            f"--learning_rate must be > 0 (a rate of 0 leaves the model unchanged: nothing to compare), got {learning_rate}."
        )
    try:
        if model is not None:
            check_model_source(model, "--model_name_or_path")
        if dataset is not None:
            check_dataset_source(dataset, "--dataset_name")
    except InputError as error:
        raise ConfigError(str(error)) from None
