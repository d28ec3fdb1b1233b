"""Accuracy (and macro F1) as an `evaluate` metric module that ships with hf_gradaccum.

`evaluate.load("accuracy")` downloads its script from the Hugging Face Hub, which fails offline. This module has the
same interface and is loaded from its path: `evaluate.load(harness.metrics.metric_path("accuracy"))`. F1 is
computed by hand so that neither scikit-learn nor the network is needed.
"""

from __future__ import annotations

import datasets
import evaluate

_DESCRIPTION = """
Accuracy is the fraction of predictions equal to their reference: (TP + TN) / (TP + TN + FP + FN) for two classes.
Macro F1 is the unweighted mean over classes of 2 * precision * recall / (precision + recall), so a classifier that
always predicts the majority class scores well in accuracy but not in macro F1.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`, defaults to `True`): if `False`, return the number of correct predictions instead of the
        fraction.
    sample_weight (`list` of `float`, *optional*): per-sample weights for accuracy.

Returns:
    accuracy (`float` or `int`): fraction (or, with `normalize=False`, number) of correct predictions.
    macro_f1 (`float`): mean over the classes present in `predictions` or `references` of the per-class F1.

Examples:
    >>> import evaluate
    >>> from harness.metrics import metric_path
    >>> metric = evaluate.load(metric_path("accuracy"))
    >>> metric.compute(predictions=[0, 1, 1, 1], references=[0, 1, 0, 1])
    {'accuracy': 0.75, 'macro_f1': 0.7333333333333334}
"""

_CITATION = """\
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and others},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


def macro_f1(predictions: list[int], references: list[int]) -> float:
    """Unweighted mean of the per-class F1 over every class seen in `predictions` or `references`."""
    classes = sorted(set(predictions) | set(references))
    if not classes:
        return 0.0
    pairs = list(zip(predictions, references, strict=True))
    scores = []
    for c in classes:
        tp = sum(p == c and r == c for p, r in pairs)
        fp = sum(p == c and r != c for p, r in pairs)
        fn = sum(p != c and r == c for p, r in pairs)
        # F1 = 2TP / (2TP + FP + FN); a class with no TP, FP or FN cannot occur here (it was seen somewhere).
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
            reference_urls=[
                "https://en.wikipedia.org/wiki/Accuracy_and_precision",
                "https://en.wikipedia.org/wiki/F-score",
            ],
        )

    def _compute(self, predictions, references, normalize: bool = True, sample_weight=None) -> dict[str, float]:
        predictions = [int(p) for p in predictions]
        references = [int(r) for r in references]
        weights = [1.0] * len(references) if sample_weight is None else [float(w) for w in sample_weight]
        if len(weights) != len(references):
            raise ValueError(f"`sample_weight` has {len(weights)} entries for {len(references)} references.")
        correct = sum(w for p, r, w in zip(predictions, references, weights, strict=True) if p == r)
        total = sum(weights)
        if normalize:
            accuracy = float(correct / total) if total else 0.0
        else:
            accuracy = int(correct) if sample_weight is None else float(correct)
        return {"accuracy": accuracy, "macro_f1": float(macro_f1(predictions, references))}
