"""`WideningAdd`: a bf16/fp16 gradient added into an fp32 buffer on the CPU, widened chunk by chunk, gives exactly the
values of torch's one mixed-dtype `add_` (bitwise), at any size, across chunk boundaries and for non-contiguous
gradients."""

from __future__ import annotations

import pytest
import torch

from hf_gradaccum.engine.buffers import WIDEN_MIN_NUMEL, FlatGradientBuffers, WideningAdd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [7, WIDEN_MIN_NUMEL, 3 * 1000 + 17, 250_003])
def test_widened_add_equals_the_mixed_dtype_add_bitwise(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=g)
    src = (torch.randn(numel, generator=g) * 3).to(dtype)
    expected = start.clone().add_(src, alpha=0.37)
    got = WideningAdd(chunk_numel=1000)(start.clone(), src, 0.37)
    assert torch.equal(got, expected)


def test_non_contiguous_gradient_and_repeated_folds():
    g = torch.Generator().manual_seed(0)
    dst = torch.zeros(300, 200)
    expected = dst.clone()
    add = WideningAdd(chunk_numel=4096)
    for k in range(3):
        src = torch.randn(200, 300, generator=g).to(torch.bfloat16).t()  # transposed: not contiguous
        assert not src.is_contiguous()
        add(dst, src, 1.0 / (k + 1))
        expected.add_(src, alpha=1.0 / (k + 1))
    assert torch.equal(dst, expected)


def test_flat_buffers_fold_bf16_gradients_as_the_mixed_add():
    model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Linear(128, 4)).to(torch.bfloat16)
    params = list(model.parameters())
    buffers = FlatGradientBuffers(params, torch.float32)
    grads = [torch.randn_like(p) for p in params]
    for i, grad in enumerate(grads):
        buffers.fold(i, grad, 3.0)
        buffers.fold(i, grad, 0.5)
    for view, grad in zip(buffers.views, grads, strict=True):
        assert torch.equal(view, torch.zeros_like(view).add_(grad, alpha=3.0).add_(grad, alpha=0.5))
