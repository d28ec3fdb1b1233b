"""FSDP2 `fsdp_reduce_schedule="once_per_window"` worker, on `world_size` gloo CPU processes: the refusals (bf16
no-sync accumulation, fp16 recompute), fp32 parity with the hand-computed large batch over 3 windows (uneven
micro-batches, different token counts per rank, clipping in window 2, a partial last window), how often the
post-accumulate-grad hook fires under each schedule, FSDP2's unsharded gradient bytes mid-window, and a window whose
last micro-batch has a NaN loss on one rank (skipped on every rank, nothing leaks into the next window).

Usage: python tests/workers/fsdp2_schedule.py WORLD_SIZE OUT_JSON
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum import DynamicLossScaler, GradientAccumulator  # noqa: E402
from tests.workers.fsdp2_parity import CLIP, LR, STEPS, data, loss_fn, make_model, reference  # noqa: E402
from tests.workers.gloo_spawn import run_gloo  # noqa: E402

MICRO_BATCHES = (STEPS, STEPS, STEPS - 1)  # the last window is partial


def sharded_model(policy=None, dtype=torch.float32) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model().to(dtype)
    policy = policy or MixedPrecisionPolicy()
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def refusals() -> dict[str, str]:
    """The message each inexact or impossible combination raises (`None`: accepted)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fp16_fp32 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    cases = {
        "bf16_params_no_reduce_dtype": lambda: GradientAccumulator(
            sharded_model(bf16), 4, fsdp_reduce_schedule="once_per_window"
        ),
        "bf16_model_no_policy": lambda: GradientAccumulator(
            sharded_model(dtype=torch.bfloat16), 4, fsdp_reduce_schedule="once_per_window"
        ),
        "fp16_recompute": lambda: GradientAccumulator(
            sharded_model(fp16_fp32), 4, loss_scaler=DynamicLossScaler(), fsdp_reduce_schedule="once_per_window"
        ),
        "fp16_skip": lambda: GradientAccumulator(
            sharded_model(fp16_fp32),
            4,
            loss_scaler=DynamicLossScaler(),
            overflow_policy="skip",
            fsdp_reduce_schedule="once_per_window",
        ),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def train(
    rank: int, windows: list, schedule: str, nan_window: int | None = None, save_mid_window: bool = False
) -> dict:
    """Train over `windows`; window `nan_window` (if any) has a NaN loss in its last micro-batch on the last rank;
    `save_mid_window` takes `state_dict()` after the first micro-batch (it must flush FSDP2's unsynced gradients)."""
    model = sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = GradientAccumulator(model, gradient_accumulation_steps=STEPS, fsdp_reduce_schedule=schedule)
    fired = []
    model[1].weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    hooks_per_window, unsharded_bytes, applied, data_window, saved_norm = [], [], [], 0, None
    for w, ranks in enumerate(windows):
        fired.clear()
        micros = ranks[rank]
        for k, (x, y) in enumerate(micros):
            loss = loss_fn(model, x, y)
            if w == nan_window and k == len(micros) - 1 and rank == len(ranks) - 1:
                loss = loss * float("nan")
            acc.backward(loss, num_items=int((y != -100).sum()))
            if k == 0:
                unsharded_bytes.append(
                    acc.fsdp_schedule.unsharded_gradient_bytes() if schedule != "every_micro_batch" else 0
                )
                if save_mid_window and w == 0:
                    saved_norm = float(acc.state_dict()["window"]["buffers"][0].norm())
        result = acc.step(opt, max_grad_norm=CLIP if data_window == 1 and w != nan_window else None)
        applied.append(result.applied)
        data_window += w != nan_window
        hooks_per_window.append(len(fired))
    weights = [p.full_tensor().detach().double() for p in model.parameters()]
    after = acc.fsdp_schedule.unsharded_gradient_bytes() if schedule != "every_micro_batch" else 0
    return {
        "weights": weights,
        "hooks_per_window": hooks_per_window,
        "unsharded_bytes_after_first_micro_batch": unsharded_bytes,
        "unsharded_bytes_after_training": after,
        "applied": applied,
        "skipped": dict(acc.skipped_steps),
        "saved_buffer_norm": saved_norm,
    }


def relative(weights: list, ref: list, initial: list) -> float:
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(weights, ref, strict=True)) ** 0.5
    update = sum(float((r - i).pow(2).sum()) for r, i in zip(ref, initial, strict=True)) ** 0.5
    return diff / update


def worker(rank: int, world_size: int, out: str) -> None:
    messages = refusals()
    windows = data(world_size, MICRO_BATCHES)
    once = train(rank, windows, "once_per_window")
    every = train(rank, windows, "every_micro_batch")
    nan = train(rank, [windows[0], windows[1], *windows[1:]], "once_per_window", nan_window=1)
    saved = train(rank, windows, "once_per_window", save_mid_window=True)
    if rank == 0:
        initial, ref = reference(world_size, windows=MICRO_BATCHES)
        record = {
            "refusals": messages,
            "relative_update_error": relative(once["weights"], ref, initial),
            "every_micro_batch_relative_update_error": relative(every["weights"], ref, initial),
            "nan_window_relative_update_error": relative(nan["weights"], ref, initial),
            "saved_mid_window_relative_update_error": relative(saved["weights"], ref, initial),
            "nan_window_vs_once_max_abs_diff": max(
                float((a - b).abs().max()) for a, b in zip(nan["weights"], once["weights"], strict=True)
            ),
            "full_numel": sum(p.numel() for p in ref),
        }
        for name, run in (("once", once), ("every", every), ("nan", nan), ("saved", saved)):
            record[name] = {k: v for k, v in run.items() if k != "weights"}
        with open(out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    run_gloo(worker, int(sys.argv[1]), sys.argv[2])
