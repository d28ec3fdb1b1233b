"""FSDP2 checkpoints with `torch.distributed.checkpoint` and a real kill: two launches of WORLD_SIZE gloo processes.

`save` launch, per rank: the uninterrupted runs (fp32 and fp16, 3 windows of 3 uneven micro-batches, AdamW) are
recorded; then interrupted copies save DCP checkpoints (model and AdamW state via `get_state_dict`, the accumulator
via `AccumulatorCheckpoint`): fp16 in the middle of window 3 (after an overflow in window 1, so the scale and the
growth tracker are not their initial values), fp32 at the window 1/2 boundary and in the middle of window 2 (one of
three micro-batches folded). Right after the last checkpoint is written every rank SIGKILLs itself.

`resume` launch, per rank: each checkpoint is loaded into a freshly built, differently seeded sharded model, the run
continues from the restored `micro_step` to the end and is recorded (full weights, this rank's AdamW state, loss
scaler). Also recorded: the error raised when a mid-window checkpoint is loaded with other accumulation steps.
`other_world` launch (another WORLD_SIZE): loading the mid-window checkpoint is refused, the boundary one loads.

Usage: python tests/workers/fsdp2_checkpoint.py {save,resume,other_world} WORLD_SIZE OUT_DIR
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum import AccumulatorCheckpoint, DynamicLossScaler, GradientAccumulator  # noqa: E402
from tests.workers.fsdp2_fp16 import INJECT_MICRO, INJECT_RANK  # noqa: E402
from tests.workers.fsdp2_parity import STEPS, data, loss_fn, make_model, reference, relative_update_error, shard  # noqa: E402
from tests.workers.gloo_spawn import run_gloo, spawn_gloo, worker_device  # noqa: E402

WINDOWS, LR = 3, 1e-2
TOTAL = WINDOWS * STEPS
# checkpoint name -> (fp16, position: micro-batches done when it is saved)
CHECKPOINTS = {"fp16_mid": (True, 2 * STEPS + 1), "fp32_boundary": (False, STEPS), "fp32_mid": (False, STEPS + 1)}


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def build(fp16: bool, seed: int = 0, steps: int = STEPS):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32) if fp16 else None
    model = shard(make_model(seed).to(worker_device()), policy)
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=2) if fp16 else None
    return model, adamw(model.parameters()), GradientAccumulator(model, steps, loss_scaler=scaler)


def train(rank: int, world_size: int, run, fp16: bool, start: int, stop: int) -> None:
    """Micro-batches `start` to `stop - 1` of the run (position = window * STEPS + micro); steps at window ends.
    fp16: the first attempt of one micro-batch of window 1 on rank `INJECT_RANK` overflows (recomputed)."""
    model, opt, acc = run
    windows = data(world_size, WINDOWS)
    for position in range(start, stop):
        w, k = divmod(position, STEPS)
        x, y = (t.to(worker_device()) for t in windows[w][rank][k])
        n = int((y != -100).sum())
        if not fp16:
            acc.backward(loss_fn(model, x, y), num_items=n)
        else:
            attempts = []

            def compute_loss(x=x, y=y, w=w, k=k, attempts=attempts) -> torch.Tensor:
                attempts.append(1)
                loss = loss_fn(model, x, y)
                if rank == INJECT_RANK and (w, k) == (0, INJECT_MICRO) and len(attempts) == 1:
                    return loss.float() * 1e9  # finite loss, overflowing fp16 gradients
                return loss

            acc.accumulate_micro_batch(compute_loss, num_items=n)
        if k == STEPS - 1:
            assert acc.step(opt).applied


def record(run, path: str, **extra) -> None:
    model, opt, acc = run
    optim = [
        {k: (v.to_local() if hasattr(v, "to_local") else v).cpu().clone() for k, v in opt.state[p].items()}
        for p in model.parameters()
    ]
    torch.save(
        {
            "weights": [p.full_tensor().detach().cpu().clone() for p in model.parameters()],
            "optim": optim,
            "scaler": None if acc.loss_scaler is None else acc.loss_scaler.state_dict(),
            "applied_steps": acc.applied_steps,
            "micro_step": acc.micro_step,
            **extra,
        },
        path,
    )


def dcp_state(run) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, acc = run
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state, "accumulator": AccumulatorCheckpoint(acc)}


def load(run, checkpoint: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, _ = run
    state = dcp_state(run)
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_then_kill(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    for fp16 in (False, True):
        run = build(fp16)
        train(rank, world_size, run, fp16, 0, TOTAL)
        extra = {}
        weights = [p.full_tensor().detach().cpu().double() for p in run[0].parameters()]  # a collective: all ranks
        if rank == 0 and not fp16:
            initial, ref = reference(world_size, adamw, WINDOWS, clip_window=None)
            extra["relative_update_error"] = relative_update_error(weights, initial, ref)
        record(run, os.path.join(out, f"straight_{'fp16' if fp16 else 'fp32'}_rank{rank}.pt"), **extra)
    for fp16, names in ((True, ["fp16_mid"]), (False, ["fp32_boundary", "fp32_mid"])):
        run, done = build(fp16), 0
        for name in names:
            train(rank, world_size, run, fp16, done, CHECKPOINTS[name][1])
            done = CHECKPOINTS[name][1]
            dcp.save(dcp_state(run), checkpoint_id=os.path.join(out, name))
    dist.barrier()  # every rank's shard is on disk
    os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, world_size: int, out: str) -> None:
    for name, (fp16, position) in CHECKPOINTS.items():
        run = build(fp16, seed=1)  # other weights: everything must come from the checkpoint
        load(run, os.path.join(out, name))
        acc = run[2]
        assert acc.micro_step == position, (name, acc.micro_step, position)  # the data position to resume from
        restored = {
            "restored_micro_step": acc.micro_step,
            "restored_in_window": acc.micro_steps_in_window,
            "restored_scaler": None if acc.loss_scaler is None else acc.loss_scaler.state_dict(),
        }
        train(rank, world_size, run, fp16, acc.micro_step, TOTAL)
        record(run, os.path.join(out, f"resumed_{name}_rank{rank}.pt"), **restored)
    run = build(False, seed=1, steps=STEPS + 1)
    try:
        load(run, os.path.join(out, "fp32_mid"))
        message = None
    except ValueError as error:
        message = str(error)
    with open(os.path.join(out, f"refused_rank{rank}.json"), "w") as f:
        json.dump({"other_steps_error": message}, f)


def other_world(rank: int, world_size: int, out: str) -> None:
    """On another number of processes: the mid-window checkpoint is refused, the window-boundary one loads. Also: a
    model only partly sharded by FSDP2 is refused by `AccumulatorCheckpoint`."""
    errors = {}
    for name in ("fp32_mid", "fp32_boundary"):
        run = build(False, seed=1)
        try:
            load(run, os.path.join(out, name))
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
        errors[f"{name}_micro_step"] = run[2].micro_step
    from torch.distributed.fsdp import fully_shard

    partly_sharded = make_model()
    fully_shard(partly_sharded[1])  # the embedding and the last layer stay plain tensors
    try:
        AccumulatorCheckpoint(GradientAccumulator(partly_sharded, STEPS))
        errors["partly_sharded"] = None
    except ValueError as error:
        errors["partly_sharded"] = str(error)
    with open(os.path.join(out, f"other_world{world_size}_rank{rank}.json"), "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    mode, world, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "save":
        codes = spawn_gloo(save_then_kill, world, out_dir)
        with open(os.path.join(out_dir, "save_exit_codes.json"), "w") as f:
            json.dump(codes, f)
    else:
        run_gloo({"resume": resume, "other_world": other_world}[mode], world, out_dir)
