"""Other libraries' trainers composed with `GradAccumTrainer`: how each of their losses accumulates exactly, or why it
is refused.

May import: `engine/`, `helpers/`, `verification/`, `config/`, `distributed/`, `losses/`. The Trainer reaches this
folder through `registry.py` only, so a new integration is one module here and its rows in the registry.

- `registry.py`: for each (trainer class, loss) how it accumulates, the refusals, and the window features a composed
  trainer needs (`composed_losses_for`);
- `trl/`: TRL's trainers, one module per family of losses;
- `sentence_transformers/`: sentence-transformers' trainers, routed per loss.
"""

from ..config.compat import check_transformers_version

check_transformers_version()
