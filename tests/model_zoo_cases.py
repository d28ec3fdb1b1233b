"""The model zoo: transformers model families with a training head, each built tiny and random-init from a shrunken
config (nothing is downloaded), trained for one optimizer step on the same window of `ROWS` rows three ways, each from
the same initial weights (CPU fp32, SGD, constant learning rate, no clipping, no weight decay, sequential order):

- `reference`: the stock `transformers.Trainer` on the window as one batch (`ROWS` x 1);
- `stock`: the stock `Trainer` at `MICRO` x `STEPS` (what plain accumulation gives);
- `ours`: `GradAccumTrainer` with `GradAccumArguments` and default accumulation options, at `MICRO` x `STEPS`.

Each of `stock` and `ours` is classified against the reference: `exact` (relative update difference
`||d - d_ref|| / ||d_ref|| <= RTOL`), `refused` (an exception whose class is defined in `hf_gradaccum`, raised with the
weights unchanged; its first line kept), `silent` (trained, not exact) or `crashed` (any other exception, or a
refusal after the weights moved).

Every dropout-like probability of the config is set to 0, so that the one batch and the micro-batches see the same
function; BatchNorm is kept as it is (its batch statistics are a real coupling of the rows).

The window's rows come in two variants (`counts`): `"default"`, where the counts a loss can divide by (label tokens,
attended tokens, masked tokens, target lengths, boxes) differ from row to row; and `"between"`, where every such count
is the same for every row of a micro-batch and differs between micro-batches (micro-batch `m` is rows
`m * MICRO ... (m + 1) * MICRO - 1` in the sequential order: `BETWEEN_ATTENDED[m]` attended tokens and
`BETWEEN_ITEMS[m]` label tokens / masked tokens / target tokens / boxes / masked frames per row). Within a micro-batch
every normalisation rule then weighs the rows alike; only the micro-batches tell them apart. `"between"` changes the
token, seq2seq, CTC, detection, segmentation, MoE and pre-training rows; sequence / image / audio classification and
the contrastive families have no per-row count to vary and keep their default rows (so does ViT-MAE: its mask ratio
is one config value for every row).

`benchmarks/model_zoo.py` runs every family in its own process and writes the table; `tests/test_model_zoo.py`
asserts the classification on real runs.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tests.composition_cases import TRAIN_ARGS as PARITY_ARGS
from tests.composition_cases import flat_trainable

RTOL = 1e-5
ROWS, MICRO, STEPS = 12, 4, 3
SEQ_LEN = 12
VOCAB = 99
IMAGE_SIZE = 32
AUDIO_SAMPLES = 4000
NUM_LABELS = 3
LEARNING_RATE = 0.1
# The `counts` variants of the window's rows (module docstring); "default" is the zoo's original data.
COUNTS = ("default", "between")
# counts="between": per micro-batch (in order), the attended tokens of every row, and the label tokens, masked tokens,
# target tokens, detection boxes or masked frames of every row.
BETWEEN_ATTENDED = (5, 8, 11)
BETWEEN_ITEMS = (2, 3, 4)
# Special token ids kept below the first ordinary token, so that no ordinary token is read as padding or EOS.
PAD_ID, BOS_ID, EOS_ID, MASK_ID, FIRST_TOKEN = 0, 1, 2, 3, 5

MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "pretraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-cls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio-cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "detection": "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
    "segmentation": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    # The two tasks below have no mapping of their own: their families are the base models with `return_loss`
    # (contrastive) and the MoE language models whose router auxiliary loss is switched on.
    "contrastive": "MODEL_MAPPING_NAMES",
    "moe": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
}
TASKS = tuple(MAPPINGS)

# The default selection: breadth across the tasks within a run of minutes on two CPU cores. `--all` in the benchmark
# takes every entry of the mappings instead.
DEFAULT_FAMILIES: dict[str, tuple[str, ...]] = {
    "causal-lm": ("llama", "gpt2", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "falcon",
                  "gpt_neox", "opt", "bloom", "mpt", "gptj", "codegen", "olmo", "olmo2", "stablelm", "starcoder2",
                  "cohere", "mamba", "xglm", "biogpt", "granite", "gpt_bigcode", "gpt_neo"),
    "masked-lm": ("bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
                  "mpnet", "modernbert", "convbert", "funnel", "mobilebert", "squeezebert"),
    "pretraining": ("bert", "albert", "electra", "funnel", "megatron-bert", "mobilebert", "ernie", "fnet",
                    "vit_mae", "wav2vec2"),
    "seq2seq": ("bart", "t5", "mbart", "pegasus", "marian", "blenderbot", "m2m_100", "mt5", "led", "plbart",
                "umt5", "longt5"),
    "seq-cls": ("bert", "roberta", "distilbert", "deberta-v2", "llama", "gpt2", "qwen2", "mistral", "bart",
                "modernbert", "electra"),
    "token-cls": ("bert", "roberta", "distilbert", "deberta-v2", "llama", "gpt2"),
    "image-cls": ("vit", "deit", "beit", "swin", "convnext", "convnextv2", "resnet", "regnet", "mobilenet_v1",
                  "mobilenet_v2", "efficientnet", "levit", "mobilevit", "poolformer", "dinov2", "swinv2", "cvt",
                  "pvt", "bit", "focalnet"),
    "audio-cls": ("wav2vec2", "hubert", "wavlm", "data2vec-audio", "unispeech-sat", "sew", "audio-spectrogram-transformer",
                  "whisper"),
    "ctc": ("wav2vec2", "hubert", "wavlm", "data2vec-audio", "sew", "unispeech", "wav2vec2-conformer"),
    "detection": ("yolos", "detr", "conditional_detr", "deformable_detr", "table-transformer", "rt_detr", "dab-detr"),
    "segmentation": ("segformer", "beit", "mobilenet_v2", "mobilevit", "dpt", "upernet", "data2vec-vision"),
    "contrastive": ("clip", "siglip", "align", "blip", "chinese_clip", "owlvit", "groupvit", "altclip"),
    "moe": ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "switch_transformers", "nllb-moe"),
}  # fmt: skip

# The families of the table: what the library must make exact or refuse, and the controls.
KEY_FAMILIES = (
    "image-cls/resnet", "image-cls/mobilenet_v2", "contrastive/clip", "contrastive/siglip", "moe/mixtral",
    "moe/qwen2_moe", "ctc/wav2vec2:sum", "ctc/wav2vec2:mean", "pretraining/bert", "detection/yolos",
    "image-cls/convnext", "causal-lm/llama", "seq-cls/bert",
)  # fmt: skip

# Families with more than one run: the variant's label and its config fields.
VARIANTS: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("ctc", "wav2vec2"): {"sum": {"ctc_loss_reduction": "sum"}, "mean": {"ctc_loss_reduction": "mean"}},
}

# Where the generic shrink does not give a model that builds and runs: config fields per (task or "*", model type).
OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {
    ("*", "mobilenet_v2"): {"depth_multiplier": 0.35, "image_size": IMAGE_SIZE},
    ("*", "mobilenet_v1"): {"depth_multiplier": 0.25, "image_size": IMAGE_SIZE},
    ("*", "efficientnet"): {"width_coefficient": 0.25, "depth_coefficient": 1.0, "hidden_dim": 320,
                            "image_size": 32},
    ("*", "mobilevit"): {"image_size": 32, "patch_size": 2, "hidden_sizes": [16, 24, 32],
                         "neck_hidden_sizes": [8, 8, 16, 16, 24, 24, 32], "num_attention_heads": 2},
    ("*", "yolos"): {"image_size": [32, 32], "patch_size": 8, "num_detection_tokens": 5},
    ("*", "big_bird"): {"attention_type": "original_full"},
    ("*", "longt5"): {"encoder_attention_type": "local"},
    ("*", "swin"): {"window_size": 2, "depths": [1, 1, 1], "num_heads": [1, 1, 1]},
    ("*", "levit"): {"image_size": 64, "patch_size": 16, "hidden_sizes": [16, 24, 32], "num_attention_heads": [1, 1, 1],
                     "depths": [1, 1, 1], "key_dim": [8, 8, 8]},
    ("*", "rt_detr"): {"encoder_in_channels": [32, 64, 64], "decoder_in_channels": [32, 32, 32]},
    # ALIGN compares the text projection with the pooled vision features as they are: the same width.
    ("*", "align"): {"projection_dim": 80, "vision_config": {"width_coefficient": 0.25, "depth_coefficient": 1.0}},
    ("*", "bit"): {"num_groups": 4},
    ("pretraining", "wav2vec2"): {"mask_time_prob": 0.05},  # its masked-frame embedding exists only when masking
    # Every layer sparse: the generic two layers would otherwise have no router at all.
    ("*", "nllb-moe"): {"encoder_sparse_step": 1, "decoder_sparse_step": 1},
    ("*", "switch_transformers"): {"num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2},
    ("*", "dpt"): {"num_hidden_layers": 4, "backbone_out_indices": [0, 1, 2, 3]},
    ("segmentation", "beit"): {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4], "auxiliary_channels": 32},
    ("segmentation", "data2vec-vision"): {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4], "auxiliary_channels": 32},
    ("*", "gpt_neo"): {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
}  # fmt: skip

# Why a family is not run, where that is known before trying.
NOT_RUN: dict[str, str] = {}

SIZES: dict[str, int] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "word_embed_proj_dim": 32, "embedding_size": 32,
    "projection_dim": 16, "projection_size": 32, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "ffn_dim": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64, "n_inner": 64, "hidden_dim": 64, "d_kv": 8,
    "head_dim": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "n_positions": 64, "num_local_experts": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "n_routed_experts": 4, "image_size": IMAGE_SIZE, "num_channels": 3,
    "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "num_queries": 8,
    "encoder_hidden_dim": 32, "rotary_dim": 4, "decoder_hidden_size": 32, "num_detection_tokens": 5,
}  # fmt: skip
SPECIAL_TOKENS = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                  "decoder_start_token_id": PAD_ID, "sep_token_id": EOS_ID, "cls_token_id": BOS_ID}  # fmt: skip
# Config fields that draw random numbers in training: zeroed, so that the runs see one function.
RANDOM_FIELD = re.compile(r"drop|_prob$|^mask_.*_prob|jitter|stochastic_depth")


@dataclass
class Family:
    """One model family of the zoo: a model class in one task, optionally one variant of its config.

    Args:
        task: one of `TASKS`.
        model_type: the config's `model_type` (the key in transformers' mappings).
        class_name: the model class.
        variant: a label for `settings` (empty for the default config).
        settings: config fields of the variant.
    """

    task: str
    model_type: str
    class_name: str
    variant: str = ""
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.task}/{self.model_type}" + (f":{self.variant}" if self.variant else "")


@dataclass
class Outcome:
    """One run classified against the reference: `verdict` in exact / refused / silent / crashed; `error` the
    relative update difference where it trained; `message` the refusal's or the crash's first line."""

    verdict: str
    error: float | None = None
    message: str = ""


def mapping(task: str) -> dict[str, str]:
    """`model_type -> model class name` of the task's transformers mapping (restricted for contrastive and MoE)."""
    from transformers.models.auto import modeling_auto

    names = dict(getattr(modeling_auto, MAPPINGS[task]))
    if task == "contrastive":
        return {t: c for t, c in names.items() if isinstance(c, str) and _forward_has(c, "return_loss")}
    if task == "moe":
        return {t: c for t, c in {**names, **_seq2seq_moe()}.items() if _config_has(t, "output_router_logits")}
    return {t: _first_class(c) for t, c in names.items()}


def _seq2seq_moe() -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    return {
        t: c
        for t, c in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.items()
        if "moe" in t or "switch" in t
    }


def _forward_has(class_name: str, argument: str) -> bool:
    try:
        return argument in inspect.signature(model_class(class_name).forward).parameters
    except Exception:  # a class that does not import here is listed by the caller as not buildable
        return False


def _config_has(model_type: str, name: str) -> bool:
    from transformers import CONFIG_MAPPING

    try:
        return name in inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters or hasattr(
            CONFIG_MAPPING[model_type](), name
        )
    except Exception:
        return False


def model_class(class_name: str) -> type:
    """The transformers model class of that name."""
    import transformers

    return getattr(transformers, class_name)


def families(tasks: tuple[str, ...] = TASKS, everything: bool = False) -> list[Family]:
    """The zoo's families: for each task, the default selection (`DEFAULT_FAMILIES`) or, with `everything`, every
    entry of its mapping; one `Family` per variant where `VARIANTS` has some.

    Example:

    ```python
    >>> from tests.model_zoo_cases import families
    >>> [f.id for f in families(("ctc",))][:2]
    ['ctc/wav2vec2:sum', 'ctc/wav2vec2:mean']
    ```
    """
    out = []
    for task in tasks:
        if everything:
            names = mapping(task)
        else:
            from transformers.models.auto import modeling_auto

            known = {**getattr(modeling_auto, MAPPINGS[task]), **(_seq2seq_moe() if task == "moe" else {})}
            names = {t: _first_class(known.get(t, "?")) for t in DEFAULT_FAMILIES[task]}
        for model_type, class_name in names.items():
            variants = VARIANTS.get((task, model_type), {"": {}})
            for variant, settings in variants.items():
                out.append(Family(task, model_type, class_name, variant, settings))
    return out


def find_family(family_id: str) -> Family:
    """The `Family` of an id such as `ctc/wav2vec2:sum`, whether or not it is in the default selection."""
    task, rest = family_id.split("/", 1)
    model_type, _, variant = rest.partition(":")
    from transformers.models.auto import modeling_auto

    known = {**getattr(modeling_auto, MAPPINGS[task]), **(_seq2seq_moe() if task == "moe" else {})}
    settings = VARIANTS.get((task, model_type), {}).get(variant, {})
    return Family(task, model_type, _first_class(known.get(model_type, "?")), variant, settings)


def _first_class(names: str | tuple[str, ...]) -> str:
    """A mapping entry's model class (the first, where it lists several: DeiT's with and without a teacher)."""
    return names if isinstance(names, str) else names[0]


# ---------------------------------------------------------------------------------------------------------------
# tiny configs


def _shrunk_list(name: str, value: list) -> list | None:
    """Small values for a list of per-stage sizes (conv nets, hierarchical vision transformers), same length."""
    n = len(value)
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    if name in ("depths", "num_layers"):
        return [1] * n
    if name in ("hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes"):
        return [min(16 * 2**i, 64) for i in range(n)]
    if name in ("num_heads", "num_attention_heads", "encoder_attention_heads"):
        return [1] * n
    return None


def shrink_fields(config: Any) -> dict[str, Any]:
    """The fields of `config` (an instance with its class's defaults) that make it tiny and deterministic: sizes from
    `SIZES`, per-stage lists, special token ids inside the small vocabulary, every dropout-like probability 0, and
    sub-configs (text / vision / encoder / decoder / backbone) shrunk the same way, as dicts."""
    values = config.to_dict()
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if name in SIZES and isinstance(value, int):
            out[name] = min(value, SIZES[name]) if name not in ("image_size",) else SIZES[name]
        elif name in SIZES and isinstance(value, (list, tuple)) and name == "image_size":
            out[name] = [IMAGE_SIZE, IMAGE_SIZE]
        elif name == "patch_size" and isinstance(value, int):
            out[name] = 4 if value <= 4 else 8
        elif isinstance(value, list) and (small := _shrunk_list(name, value)) is not None:
            out[name] = small
        elif name in ("conv_dim",) and isinstance(value, (list, tuple)):
            out[name] = [32] * len(value)
        elif isinstance(value, float) and value > 0 and RANDOM_FIELD.search(name):
            out[name] = 0.0
        elif name in SPECIAL_TOKENS and isinstance(value, int) and value >= FIRST_TOKEN:
            out[name] = SPECIAL_TOKENS[name]
        elif name == "pad_token_id" and value is None and "vocab_size" in values:
            out[name] = PAD_ID  # a padding id, as any tokenizer used for batches of uneven rows has
    # `head_dim` is only consistent with the shrunk width where the config fixes it.
    if "head_dim" in out and values.get("head_dim") is not None:
        heads = out.get("num_attention_heads", values.get("num_attention_heads"))
        width = out.get("hidden_size", values.get("hidden_size"))
        if isinstance(heads, int) and isinstance(width, int) and heads:
            out["head_dim"] = max(width // heads, 4)
    elif "head_dim" in out:
        del out["head_dim"]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out[name] = {**sub.to_dict(), **shrink_fields(sub)}
    return out


def tiny_config(family: Family) -> Any:
    """The family's config: its class's defaults, shrunk (`shrink_fields`), then `OVERRIDES` and the variant's
    settings; `NUM_LABELS` labels for classification heads."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family.model_type]
    kwargs = shrink_fields(config_class())
    for key in (("*", family.model_type), (family.task, family.model_type)):
        for name, value in OVERRIDES.get(key, {}).items():
            # A sub-config's override changes the shrunk sub-config, field by field.
            merge = isinstance(value, dict) and isinstance(kwargs.get(name), dict)
            kwargs[name] = {**kwargs[name], **value} if merge else value
    if family.task == "moe":
        kwargs.update(output_router_logits=True, router_aux_loss_coef=0.02)
    if (
        getattr(config_class(), "is_encoder_decoder", False)
        and getattr(config_class(), "decoder_start_token_id", None) is None
    ):
        kwargs["decoder_start_token_id"] = PAD_ID
    if family.task == "ctc":
        kwargs.setdefault("vocab_size", 32)
    if family.task == "detection":
        kwargs.update(_detection_fields(config_class()))
    kwargs.update(family.settings)
    if family.task in ("seq-cls", "token-cls", "image-cls", "audio-cls", "detection", "segmentation"):
        kwargs["num_labels"] = NUM_LABELS
    config = config_class(**kwargs)
    return config


def _detection_fields(config: Any) -> dict[str, Any]:
    """DETR-like detectors default to a pretrained timm backbone: a tiny random-init transformers ResNet instead."""
    out: dict[str, Any] = {}
    values = config.to_dict()
    if "use_timm_backbone" in values:
        out["use_timm_backbone"] = False
    if "use_pretrained_backbone" in values:
        out["use_pretrained_backbone"] = False
    backbone = values.get("backbone_config")
    if isinstance(backbone, dict) and backbone.get("model_type") == "timm_backbone":
        from transformers import ResNetConfig

        out["backbone_config"] = ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], out_indices=backbone["out_indices"]
        )
    return out


def tiny_model(family: Family, seed: int = 0) -> torch.nn.Module:
    """The family's model, random-init with `seed`, fp32, in training mode."""
    config = tiny_config(family)
    torch.manual_seed(seed)
    model = model_class(family.class_name)(config)
    return model.float().train()


# ---------------------------------------------------------------------------------------------------------------
# inputs


def _lengths(g: torch.Generator, n: int, lo: int, hi: int) -> list[int]:
    return [int(torch.randint(lo, hi + 1, (1,), generator=g)) for _ in range(n)]


def _per_micro_batch(values: tuple[int, ...]) -> list[int]:
    """One value per row: `values[m]` for every row of micro-batch `m` (consecutive groups of `MICRO` rows, the
    sequential order of the runs).

    Example:

    ```python
    >>> from tests.model_zoo_cases import _per_micro_batch
    >>> _per_micro_batch((2, 3, 4))
    [2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    ```
    """
    assert len(values) == STEPS and ROWS == MICRO * STEPS
    return [values[r // MICRO] for r in range(ROWS)]


def _token_rows(config: Any, g: torch.Generator, counts: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids with their attention mask; rows of 4 to `SEQ_LEN` tokens (`counts="between"`: the
    `BETWEEN_ATTENDED` lengths, one per micro-batch)."""
    vocab = int(getattr(config, "vocab_size", VOCAB))
    pad = getattr(config, "pad_token_id", None)
    pad = PAD_ID if pad is None else int(pad)
    ids = torch.randint(FIRST_TOKEN, vocab, (ROWS, SEQ_LEN), generator=g)
    mask = torch.zeros(ROWS, SEQ_LEN, dtype=torch.long)
    lengths = _per_micro_batch(BETWEEN_ATTENDED) if counts == "between" else _lengths(g, ROWS, 4, SEQ_LEN)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    eos = getattr(config, "eos_token_id", None)
    for r, n in enumerate(mask.sum(1).tolist()):
        if isinstance(eos, int) and eos < vocab:
            ids[r, n - 1] = eos  # rows end with EOS, as tokenizers make them (sequence heads pool there)
    ids[mask == 0] = pad
    return ids, mask


def _hide_some(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A few -100 labels inside every third row (a masked prompt), so that rows count different label tokens."""
    labels = labels.clone()
    for r in range(0, ROWS, 3):
        labels[r, : int(torch.randint(1, 4, (1,), generator=g))] = -100
    return labels


def _last_tokens(labels: torch.Tensor, mask: torch.Tensor, items: list[int]) -> torch.Tensor:
    """`labels` kept on the last `items[r]` attended tokens of each row `r` (a completion after its prompt), -100
    elsewhere: every row has exactly `items[r]` label tokens, none at position 0 (shifted, still `items[r]`)."""
    out = torch.full_like(labels, -100)
    for r, (n, k) in enumerate(zip(mask.sum(1).tolist(), items, strict=True)):
        out[r, n - k : n] = labels[r, n - k : n]
    return out


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _vision_config(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def _image_size(config: Any) -> tuple[int, int]:
    size = getattr(_vision_config(config), "image_size", IMAGE_SIZE)
    return (size, size) if isinstance(size, int) else tuple(size)[:2]


def _pixels(config: Any, g: torch.Generator) -> torch.Tensor:
    channels = int(getattr(_vision_config(config), "num_channels", 3))
    return torch.randn(ROWS, channels, *_image_size(config), generator=g)


def window_rows(
    family: Family, config: Any, model: torch.nn.Module, seed: int = 1, counts: str = "default"
) -> list[dict[str, Any]]:
    """`ROWS` training rows with realistic inputs for the family's task (see the module docstring of the
    benchmark for each task's inputs); `counts` one of `COUNTS` (the module docstring)."""
    if counts not in COUNTS:
        raise ValueError(f"counts={counts!r}: one of {COUNTS}")
    between = counts == "between"
    items = _per_micro_batch(BETWEEN_ITEMS)
    g = torch.Generator().manual_seed(seed)
    task, forward = family.task, inspect.signature(model.forward).parameters
    batch: dict[str, Any] = {}
    if task in ("causal-lm", "moe") and family.class_name.endswith("ForConditionalGeneration"):
        task = "seq2seq"
    if task == "pretraining":
        task = _pretraining_kind(family, forward)
    if task in ("causal-lm", "moe", "masked-lm", "seq-cls", "token-cls", "seq2seq", "mlm+head", "discriminator"):
        # Sequence classification has no per-row count to vary: its default rows in either variant.
        ids, mask = _token_rows(_text_config(config), g, counts if task != "seq-cls" else "default")
        batch = {"input_ids": ids, "attention_mask": mask}
        if task in ("causal-lm", "moe"):
            labels = ids.masked_fill(mask == 0, -100)
            batch["labels"] = _last_tokens(labels, mask, items) if between else _hide_some(labels, g)
        elif task in ("masked-lm", "mlm+head"):
            if between:  # exactly items[r] masked tokens per row, among its attended tokens
                chosen = torch.zeros(ROWS, SEQ_LEN, dtype=torch.bool)
                for r, (n, k) in enumerate(zip(mask.sum(1).tolist(), items, strict=True)):
                    chosen[r, torch.randperm(n, generator=g)[:k]] = True
            else:
                chosen = (torch.rand(ROWS, SEQ_LEN, generator=g) < 0.3) & (mask == 1)
                chosen[:, 0] |= True
            batch["labels"] = ids.masked_fill(~chosen, -100)
            batch["input_ids"] = ids.masked_fill(chosen, MASK_ID)
            if "next_sentence_label" in forward:
                batch["next_sentence_label"] = torch.randint(0, 2, (ROWS,), generator=g)
            if "sentence_order_label" in forward:
                batch["sentence_order_label"] = torch.randint(0, 2, (ROWS,), generator=g)
        elif task == "discriminator":
            batch["labels"] = torch.randint(0, 2, (ROWS, SEQ_LEN), generator=g)
        elif task == "seq-cls":
            batch["labels"] = torch.randint(0, NUM_LABELS, (ROWS,), generator=g)
        elif task == "token-cls":
            labels = torch.randint(0, NUM_LABELS, (ROWS, SEQ_LEN), generator=g).masked_fill(mask == 0, -100)
            batch["labels"] = _last_tokens(labels, mask, items) if between else _hide_some(labels, g)
        else:
            labels = torch.randint(FIRST_TOKEN, int(_text_config(config).vocab_size), (ROWS, SEQ_LEN), generator=g)
            for r, n in enumerate(items if between else _lengths(g, ROWS, 2, SEQ_LEN)):
                labels[r, n:] = -100
            batch["labels"] = labels
    elif task in ("image-cls", "mae"):
        batch = {"pixel_values": _pixels(config, g)}
        if task == "image-cls":
            batch["labels"] = torch.randint(0, NUM_LABELS, (ROWS,), generator=g)
        else:
            # The masking noise as an input, so that every run masks the same patches.
            patches = (_image_size(config)[0] // config.patch_size) * (_image_size(config)[1] // config.patch_size)
            batch["noise"] = torch.rand(ROWS, patches, generator=g)
    elif task == "segmentation":
        h, w = _image_size(config)
        labels = torch.randint(0, NUM_LABELS, (ROWS, h, w), generator=g)
        if between:  # an ignored band of (m + 1) / 8 of the image's height in micro-batch m
            for r in range(ROWS):
                labels[r, : (r // MICRO + 1) * h // 8] = 255
        else:
            labels[:, : h // 4, : w // 4] = 255  # an ignored corner, as annotation tools leave
        batch = {"pixel_values": _pixels(config, g), "labels": labels}
    elif task in ("audio-cls", "ctc", "wav2vec2-pretraining"):
        batch = _audio_inputs(family, config, forward, g)
        if task == "audio-cls":
            batch["labels"] = torch.randint(0, NUM_LABELS, (ROWS,), generator=g)
        elif task == "ctc":
            labels = torch.randint(1, int(config.vocab_size), (ROWS, 5), generator=g)
            for r, n in enumerate(items if between else _lengths(g, ROWS, 1, 5)):
                labels[r, n:] = -100
            batch["labels"] = labels
        else:
            batch.update(_wav2vec2_pretraining_inputs(model, batch["input_values"], g, items if between else None))
    elif task == "detection":
        batch = {"pixel_values": _pixels(config, g), "labels": []}
        for n in items if between else _lengths(g, ROWS, 1, 4):
            centres = 0.25 + 0.5 * torch.rand(n, 2, generator=g)
            sizes = 0.1 + 0.3 * torch.rand(n, 2, generator=g)
            boxes = torch.cat([centres, sizes], dim=1)
            batch["labels"].append({"class_labels": torch.randint(0, NUM_LABELS, (n,), generator=g), "boxes": boxes})
    elif task == "contrastive":
        ids, mask = _token_rows(_text_config(config), g)
        batch = {"input_ids": ids, "pixel_values": _pixels(config, g)}
        if "attention_mask" in forward and family.model_type not in ("siglip",):
            batch["attention_mask"] = mask
        else:  # padded to the maximum length without a mask, as SigLIP's processor does
            batch["input_ids"] = ids
    else:
        raise NotImplementedError(f"no inputs for task {task!r}")
    rows = []
    for r in range(ROWS):
        row = {k: (v[r] if isinstance(v, (torch.Tensor, list)) else v) for k, v in batch.items()}
        rows.append(row)
    return rows


def _pretraining_kind(family: Family, forward: Any) -> str:
    name = family.class_name
    if name.startswith(("Electra", "Funnel")):
        return "discriminator"
    if name.startswith("ViTMAE"):
        return "mae"
    if name.startswith("Wav2Vec2"):
        return "wav2vec2-pretraining"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    if name.endswith("ForConditionalGeneration"):
        return "seq2seq"
    if "labels" in forward and ("input_ids" in forward):
        return "mlm+head"
    raise NotImplementedError(f"{name}: a pre-training head this zoo builds no inputs for")


def _audio_inputs(family: Family, config: Any, forward: Any, g: torch.Generator) -> dict[str, torch.Tensor]:
    if "input_features" in forward:
        bins = int(getattr(config, "num_mel_bins", 80))
        frames = 2 * int(getattr(config, "max_source_positions", 1500))
        return {"input_features": torch.randn(ROWS, bins, frames, generator=g)}
    if family.model_type == "audio-spectrogram-transformer":
        return {"input_values": torch.randn(ROWS, config.max_length, config.num_mel_bins, generator=g)}
    return {"input_values": torch.randn(ROWS, AUDIO_SAMPLES, generator=g)}


def _wav2vec2_pretraining_inputs(
    model: Any, input_values: torch.Tensor, g: torch.Generator, masked_per_row: list[int] | None = None
) -> dict[str, Any]:
    """Masked time steps and sampled negatives as inputs (what the pre-training example's collator makes), drawn
    once, so that every run sees the same; with `masked_per_row`, exactly that many masked frames in each row."""
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices

    frames = int(model._get_feat_extract_output_lengths(torch.tensor(input_values.shape[1])))
    state = torch.random.get_rng_state()
    import numpy as np

    np.random.seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
    if masked_per_row is None:
        masked = _compute_mask_indices((ROWS, frames), mask_prob=0.5, mask_length=2, min_masks=1)
    else:
        masked = np.zeros((ROWS, frames), dtype=bool)
        for r, k in enumerate(masked_per_row):
            masked[r, np.random.choice(frames, size=k, replace=False)] = True
    negatives = _sample_negative_indices((ROWS, frames), 4, mask_time_indices=masked)
    torch.random.set_rng_state(state)
    # The sampler returns indices into the flattened batch; per row they are made relative to the row, and
    # `collate` puts each row's offset back for the batch it lands in, as the pre-training collator does.
    negatives = torch.tensor(negatives, dtype=torch.long) - (torch.arange(ROWS) * frames)[:, None, None]
    return {"mask_time_indices": torch.tensor(masked, dtype=torch.bool), "sampled_negative_indices": negatives}


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack every tensor field; detection `labels` stay a list of dicts; non-tensor fields (`return_loss`) are
    passed once."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.stack([row[key] for row in rows])
            if key == "sampled_negative_indices":
                out[key] = out[key] + (torch.arange(len(rows)) * value.shape[0])[:, None, None]
        elif isinstance(value, dict):
            out[key] = [row[key] for row in rows]
        else:
            out[key] = value
    return out


class Rows(torch.utils.data.Dataset):
    """The window's rows as a dataset (read in order: the runs use sequential sampling)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def with_return_loss(collator: Callable) -> Callable:
    """`collator` with `return_loss=True` added to every batch (the contrastive models compute their loss on it)."""

    def collate_with_loss(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {**collator(rows), "return_loss": True}

    return collate_with_loss


# ---------------------------------------------------------------------------------------------------------------
# runs

# The parity tests' SGD settings (constant learning rate, no clipping, no weight decay, sequential order, CPU), for
# one optimizer step on a dataset whose rows are already tensors.
TRAIN_ARGS = {
    **{
        k: v for k, v in PARITY_ARGS.items() if k not in ("per_device_train_batch_size", "gradient_accumulation_steps")
    },
    "learning_rate": LEARNING_RATE,
    "max_steps": 1,
    "remove_unused_columns": False,
    "dataloader_drop_last": False,
}
RUNS = {"reference": (ROWS, 1), "stock": (MICRO, STEPS), "ours": (MICRO, STEPS)}


def train_once(kind: str, model: torch.nn.Module, rows: list[dict[str, Any]], output_dir: str) -> torch.Tensor:
    """One optimizer step of `model` (trained in place) on `rows` with the run `kind` of `RUNS`; returns the update
    of its trainable weights."""
    from transformers import Trainer, TrainingArguments

    micro, steps = RUNS[kind]
    if kind == "ours":
        from hf_gradaccum import GradAccumArguments, GradAccumTrainer

        trainer_cls, args_cls = GradAccumTrainer, GradAccumArguments
    else:
        trainer_cls, args_cls = Trainer, TrainingArguments
    args = args_cls(output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=steps, **TRAIN_ARGS)
    collator = with_return_loss(collate) if "return_loss" in _forward_params(model) else collate
    before = flat_trainable(model)
    trainer = trainer_cls(model=model, args=args, train_dataset=Rows(rows), data_collator=collator)
    trainer.train()
    return flat_trainable(model) - before


def _forward_params(model: torch.nn.Module) -> Any:
    return inspect.signature(model.forward).parameters


def relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    """`||update - reference|| / ||reference||`."""
    return float((update - reference).norm() / reference.norm())


def classify(run: Callable[[], torch.Tensor], model: torch.nn.Module, reference: torch.Tensor) -> Outcome:
    """Run `run()` (one training run of `model`, returning its update) and classify it against `reference`.

    Example:

    ```python
    >>> import torch
    >>> from tests.model_zoo_cases import classify
    >>> model = torch.nn.Linear(2, 1)
    >>> classify(lambda: torch.tensor([1.0, 2.0]), model, torch.tensor([1.0, 2.0])).verdict
    'exact'
    ```
    """
    before = flat_trainable(model)
    try:
        update = run()
    except Exception as e:  # classified, not raised: the zoo reports every family
        first = (str(e).strip().splitlines() or [""])[0][:300]
        moved = not torch.equal(flat_trainable(model), before)
        if type(e).__module__.startswith("hf_gradaccum") and not moved:
            return Outcome("refused", message=f"{type(e).__name__}: {first}")
        why = " (a refusal after the weights moved)" if type(e).__module__.startswith("hf_gradaccum") else ""
        return Outcome("crashed", message=f"{type(e).__name__}: {first}{why}")
    error = relative(update, reference)
    if error != error:  # NaN: the run produced no usable update
        return Outcome("crashed", message="the update is not finite")
    return Outcome("exact" if error <= RTOL else "silent", error=error)


def normalisation(family: Family, model: torch.nn.Module) -> str:
    """The loss's own normalisation in words, as far as the task and the model's modules tell it."""
    name, task = family.class_name, family.task
    words = {
        "causal-lm": "mean over shifted label tokens",
        "masked-lm": "mean over label tokens",
        "seq2seq": "mean over label tokens",
        "seq-cls": "mean over rows",
        "token-cls": "mean over label tokens",
        "image-cls": "mean over rows",
        "audio-cls": "mean over rows",
        "segmentation": "mean over labelled pixels",
        "detection": "boxes of the batch (matched, divided by the batch's box count)",
        "contrastive": "in-batch negatives inside the model (all pairs of the batch)",
        "moe": "mean over label tokens + router aux loss over the batch",
    }.get(task, "")
    if task == "ctc":
        words = {"sum": "a sum over rows", "mean": "each row / its target length, then a mean over rows"}[
            getattr(model.config, "ctc_loss_reduction", "sum")
        ]
    if task == "pretraining":
        forward = _forward_params(model)
        kind = _pretraining_kind(family, forward)
        words = {
            "discriminator": "mean over attended tokens (replaced-token detection)",
            "mae": "mean over masked patches",
            "wav2vec2-pretraining": "contrastive over masked frames, a sum + diversity term",
            "causal-lm": "mean over shifted label tokens",
            "seq2seq": "mean over label tokens",
        }.get(kind, "mean over masked-LM tokens")
        if "next_sentence_label" in forward or "sentence_order_label" in forward:
            words = "two means: masked-LM tokens + sentence-pair rows"
    if name.endswith("ForCausalLM") and task == "seq2seq":
        words = "mean over shifted label tokens"
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        words = f"batch statistics in the forward (BatchNorm); {words}"
    return words


def run_family(family: Family, counts: str = "default") -> dict[str, Any]:
    """The zoo row of one family: its three runs and their classification (a row saying why where it cannot be built
    or its reference does not train), on the window's rows of the `counts` variant (`COUNTS`)."""
    # Tiny random models warn about their own sizes; the row is the output. Restored for the caller (a test session).
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run_family(family, counts)
    finally:
        logging.disable(disabled)


def _run_family(family: Family, counts: str = "default") -> dict[str, Any]:
    start = time.time()
    row: dict[str, Any] = {"id": family.id, **asdict(family)}
    row.pop("settings")
    if counts != "default":
        row["counts"] = counts
    try:
        model = tiny_model(family)
        rows = window_rows(family, model.config, model, counts=counts)
        row["normalisation"] = normalisation(family, model)
        row["parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    except Exception as e:
        row.update(status="not built", reason=f"{type(e).__name__}: {_first_line(e)}", seconds=time.time() - start)
        return row
    with tempfile.TemporaryDirectory() as tmp:
        try:
            reference = train_once("reference", copy.deepcopy(model), rows, f"{tmp}/reference")
        except Exception as e:
            row.update(status="tiny model does not train", reason=f"{type(e).__name__}: {_first_line(e)}")
            row["traceback"] = traceback.format_exc()[-2000:]
            row["seconds"] = time.time() - start
            return row
        if not reference.norm() > 0:
            row.update(status="tiny model does not train", reason="the one-batch step does not move the weights")
            row["seconds"] = time.time() - start
            return row
        row["status"] = "run"
        for kind in ("stock", "ours"):
            copy_ = copy.deepcopy(model)
            outcome = classify(lambda m=copy_, k=kind: train_once(k, m, rows, f"{tmp}/{k}"), copy_, reference)
            row[kind] = asdict(outcome)
    row["seconds"] = time.time() - start
    return row


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
