"""What a run is configured with: `GradAccumArguments` (`TrainingArguments` plus the accumulation options), the
`GradAccumFields` mixin for other arguments classes, the checks that run with them, and the transformers releases
they run on.

May import: `engine/`, `helpers/`, and the top-level `versions.py`.

- `arguments.py`: the fields with their help, `GradAccumArguments`, `gradaccum_option` (a field's value on any
  arguments object, its default on a plain `TrainingArguments`);
- `run_batch_arguments.py`: `effective_batch_size` refused where it cannot be honoured, and the steps it derives;
- `training_checks.py`: range checks of `TrainingArguments` numbers that transformers leaves unchecked;
- `compat.py`: every transformers detail that differs between the supported releases.

Importing this folder (and any folder above it) refuses an unsupported transformers release with the supported range
in the message, before any module imports a name such a release may not have.
"""

from .compat import check_transformers_version

check_transformers_version()
