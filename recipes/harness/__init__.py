"""The parity experiment harness used by `recipes/`: configs and YAML parsing (`config`), offline assets (`assets`),
arms trained in their own processes (`arms`), parity reports and plots (`reporting`), and offline metrics
(`metrics/`). Not part of `import hf_gradaccum`; imports matplotlib lazily."""
