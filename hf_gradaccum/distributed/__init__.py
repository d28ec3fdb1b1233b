"""The engines and layouts `GradAccumTrainer` runs under, as the Trainer and Accelerate set them up: DeepSpeed, FSDP2,
tensor parallelism and HSDP, and the run's batch on any number of processes.

May import: `engine/`, `helpers/`, `config/`.

- `sharding.py`: which engines run, and FSDP2 set up for summing;
- `deepspeed.py`: DeepSpeed ZeRO 1-3, where the window is made exact through the loss handed to its engine;
- `parallelism.py`: tensor parallelism and HSDP as the Trainer sets them up (the data-parallel group);
- `run_batch.py`: `effective_batch_size` in the Trainer (the loader of the run's windows, resume on another layout).
"""

from ..config.compat import check_transformers_version

check_transformers_version()
