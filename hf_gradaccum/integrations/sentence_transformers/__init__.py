"""sentence-transformers' trainers composed with `GradAccumTrainer`: exact without configuration.

May import: the folders `integrations/` may import; never `integrations/registry.py`, which imports these modules.

- `loss_classes.py`: the loss and trainer classes sentence-transformers ships, by how they accumulate;
- `routes.py`: the route each loss takes (coupled, item mean, refused, checked), and `register_sentence_transformers_loss`;
- `embedding_losses.py`: a loss over the window's column embeddings, built from the loss's own code;
- `forward_replay.py`: a loss subclass's own `forward` replayed on the window's embeddings, checked against the model;
- `routing.py`: the mixin that routes a composed trainer's loss on the first window.
"""
