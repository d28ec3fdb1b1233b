"""The part every parity recipe shares: parse, run each arm in its own process, report.

A recipe supplies its model and data (an arguments dataclass, how to load the data, how to build one arm's trainer);
[`ParityExperiment`] does the rest the same way for every recipe: the YAML + command-line arguments, one child
process per arm (so each peak memory is its own), each arm's arguments and seed, and the parity report with the
arms' split-invariance verdicts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import evaluate
import numpy as np
import torch
from transformers import set_seed
from transformers.trainer_callback import ProgressCallback

from hf_gradaccum import GradAccumArguments

from .arms import (
    ARM_WEIGHTS_FILE,
    ArmSpec,
    ParityArguments,
    QuietProgressCallback,
    apply_memory_limit,
    arm_dir,
    arm_overrides,
    collect_arm_result,
    current_memory_mb,
    describe_device,
    describe_layout,
    failed_arm_result,
    launch_command,
    peak_memory_mb,
    per_arm_settings,
    plan_arms,
    report_parity_run,
    reset_peak_memory,
    run_arms_in_subprocesses,
    save_arm_weights,
    write_arm_result,
)
from .config import ConfigError, RecipeArgumentParser
from .metrics import metric_path
from .verification_report import add_verification_to_report, with_verification


@dataclass
class ParityExperiment:
    """
    One recipe's parity experiment: its name, its script (re-run once per arm), its own arguments dataclass and its
    default YAML config.

    Args:
        name (`str`): the recipe's name, as in the report (`"finetune_bert"`).
        script (`str`): the recipe's `__file__`; each arm runs it again with `--run_single_arm <arm>`.
        recipe_arguments (`type`): the dataclass of the recipe's model and data options.
        default_config (`Path`): the YAML whose values are the defaults (`--help` shows them).
        saved_arm (`str`, *optional*, defaults to `"accumulated"`): the arm whose model is saved into `output_dir`:
            the run a user with a small device would actually make.

    Example:

    ```python
    >>> experiment = ParityExperiment("finetune_bert", __file__, BertRecipeArguments, Path("configs/bert.yaml"))  # doctest: +SKIP
    >>> recipe_args, parity_args, training_args = experiment.parse_args(sys.argv[1:])  # doctest: +SKIP
    ```
    """

    name: str
    script: str
    recipe_arguments: type
    default_config: Path
    saved_arm: str = "accumulated"
    start_time: float = field(default_factory=time.perf_counter)

    def parse_args(self, argv: Sequence[str]) -> tuple[Any, ParityArguments, GradAccumArguments]:
        """YAML `--config` (default: the recipe's config) as defaults, command-line flags on top."""
        parser = RecipeArgumentParser(
            (self.recipe_arguments, ParityArguments, GradAccumArguments),
            default_config=self.default_config if self.default_config.is_file() else None,
            # Every arm proves split invariance on its first window unless told otherwise (`with_verification`).
            run_defaults={"verify_accumulation": "first_step"},
            fixed=per_arm_settings(),
        )
        return parser.parse_recipe_args(list(argv))

    def plan(
        self, parity_args: ParityArguments, training_args: GradAccumArguments, **plan_kwargs: Any
    ) -> list[ArmSpec]:
        """The arms to run, each with its batch layout."""
        return plan_arms(
            parity_args.arms,
            micro_batch_size=training_args.per_device_train_batch_size,
            gradient_accumulation_steps=training_args.gradient_accumulation_steps,
            **plan_kwargs,
        )

    def single_arm(self, specs: Sequence[ArmSpec], parity_args: ParityArguments) -> ArmSpec | None:
        """In a child process started by [`run`], the arm it runs; `None` in the parent."""
        if parity_args.run_single_arm is None:
            return None
        return next(spec for spec in specs if spec.name == parity_args.run_single_arm)

    def arm_arguments(
        self, spec: ArmSpec, parity_args: ParityArguments, output_dir: str, argv: Sequence[str]
    ) -> GradAccumArguments:
        """The user's arguments with this arm's batch layout and per-step logging appended (they win); seeds."""
        args = self.parse_args([*argv, *arm_overrides(spec, output_dir)])[2]
        memory_limit = apply_memory_limit(parity_args.max_memory_mb, args.device)  # on every process
        if args.process_index == 0:  # once, not once per process of a multi-process launch
            print(f"[{spec.name}] {describe_layout(spec)}; {memory_limit}")
        set_seed(args.seed)
        return args

    def train_arm(self, trainer: Any, spec: ArmSpec, *, output_dir: str, batchnorm_layers: int = 0) -> None:
        """
        Train and evaluate the arm's ready trainer, then (on the main process) write
        `<output_dir>/arms/<arm>/arm_result.json` and the arm's weights, and `save_model(output_dir)` for the arm a
        user would keep (`from_pretrained(output_dir)` then works). `batchnorm_layers`: BatchNorm layers that still
        use batch statistics, for the report.
        """
        if not trainer.args.disable_tqdm:
            trainer.remove_callback(ProgressCallback)
            trainer.add_callback(QuietProgressCallback)
        device = trainer.args.device
        reset_peak_memory(device)
        baseline = current_memory_mb(device)
        try:
            train_metrics = trainer.train().metrics
        except torch.OutOfMemoryError as error:
            # Only on CUDA with `max_memory_mb`: the emulated small device cannot hold this arm.
            if trainer.is_world_process_zero():
                write_arm_result(failed_arm_result(spec, str(error).splitlines()[0], status="oom"), output_dir)
            return
        # Read the peak now: evaluation and saving below are not what the memory limit is about.
        peak = peak_memory_mb(device)
        eval_metrics = trainer.evaluate()
        if not trainer.is_world_process_zero():
            return
        result = collect_arm_result(
            spec,
            trainer,
            train_metrics=train_metrics,
            eval_metrics=eval_metrics,
            peak_memory_mb=peak,
            baseline_memory_mb=baseline,
            wall_time_s=time.perf_counter() - self.start_time,
            batchnorm_layers=batchnorm_layers,
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        save_arm_weights(model, arm_dir(output_dir, spec.name) / ARM_WEIGHTS_FILE)
        if spec.name == self.saved_arm:
            trainer.save_model(output_dir)
        write_arm_result(result, output_dir)

    def check_layout(
        self, specs: Sequence[ArmSpec], *, train_samples: int, eval_samples: int, training_args: GradAccumArguments
    ) -> None:
        """
        Refuse, before any arm starts, layouts the data cannot fill: a micro-batch larger than the training set, or a
        step (the reference's `micro x N` samples, times the processes) larger than it.
        """
        world = training_args.world_size
        micro = training_args.per_device_train_batch_size
        if micro > train_samples:
            raise ConfigError(
                f"per_device_train_batch_size={micro} is larger than the training set ({train_samples} samples): "
                "lower it or raise max_train_samples."
            )
        largest = max(spec.effective_batch_size for spec in specs) * world
        if largest > train_samples:
            raise ConfigError(
                f"The largest arm takes {largest} samples per optimizer step (per_device_train_batch_size {micro} x "
                f"gradient_accumulation_steps {training_args.gradient_accumulation_steps} x {world} process(es)) "
                f"but the training set has only {train_samples} samples: lower one of them or raise "
                "max_train_samples."
            )
        if eval_samples < 1:
            raise ConfigError("The evaluation set is empty: raise max_eval_samples.")

    def refuse(self, error: Exception) -> int:
        """A configuration error, said in one line before any work starts; the exit status 2 of argparse."""
        print(f"{Path(self.script).name}: error: {error}", file=sys.stderr)
        return 2

    def run(
        self,
        argv: Sequence[str],
        specs: Sequence[ArmSpec],
        *,
        parity_args: ParityArguments,
        training_args: GradAccumArguments,
        metadata: dict[str, Any],
    ) -> int:
        """Run every arm in its own process, then write the parity report; returns the exit status."""
        # Every arm proves split invariance on its first window; the verdicts go into the report.
        argv = with_verification(argv, training_args)
        output_dir = Path(training_args.output_dir)
        results = run_arms_in_subprocesses(specs, script=self.script, argv=argv, output_dir=output_dir)
        metadata = {
            "recipe": self.name,
            "command": launch_command(self.script, argv),
            **metadata,
            "num_train_epochs": training_args.num_train_epochs,
            "seed": training_args.seed,
            "device": describe_device(training_args.device),
            "total_wall_time_s": time.perf_counter() - self.start_time,
        }
        status = report_parity_run(
            results, specs, metadata=metadata, parity_args=parity_args, output_dir=output_dir, saved_arm=self.saved_arm
        )
        add_verification_to_report(output_dir, specs)
        return status


def accuracy_metrics() -> Callable[[Any], dict[str, float]]:
    """`compute_metrics` for a classifier: accuracy of the arg-max logits (the metric is loaded offline)."""
    accuracy = evaluate.load(metric_path("accuracy"))

    def compute_metrics(eval_pred: Any) -> dict[str, float]:
        logits, labels = eval_pred
        return accuracy.compute(predictions=np.argmax(logits, axis=-1), references=labels)

    return compute_metrics
